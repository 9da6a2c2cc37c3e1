"""Prints pyproject.toml's dependencies, one per line, so the image installs them in a layer before the source."""

import argparse
import tomllib

p = argparse.ArgumentParser()
p.add_argument("pyproject")
p.add_argument("--extra", action="append", default=[], help="also this optional-dependencies group")
p.add_argument("--only", help="just the requirement of this distribution (e.g. torch)")
p.add_argument("--without", action="append", default=[], help="leave out this distribution")
args = p.parse_args()
project = tomllib.load(open(args.pyproject, "rb"))["project"]
deps = list(project["dependencies"])
for extra in args.extra:
    deps += project["optional-dependencies"][extra]


def name(req: str) -> str:
    for stop in "<>=!~[; ":
        req = req.split(stop)[0]
    return req.strip().lower()


for req in deps:
    if (args.only is None or name(req) == args.only) and name(req) not in args.without:
        print(req)
