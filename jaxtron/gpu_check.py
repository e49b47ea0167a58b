"""GPU acceptance in one command: tests, attention TFLOP/s and training MFU, in one JSON file.

    scripts/gpu_check.sh                     # fresh machine: installs jaxtron[cuda12,test] first
    python -m jaxtron.gpu_check --out gpu_check.json

Four parts, each its own process with its own time limit (about 4 minutes in all on one H200):

1. tests: `pytest -m gpu` (tests/test_gpu.py): the Triton flash kernels and cuDNN against the
   reference at bf16 tolerance, forward and backward, also with a sliding window; bf16 training
   steps against the fp32 step, fp8 steps against bf16; 1F1B on two GPUs where there are two;
2. kernels: `python -m jaxtron.kernels.speed` at 1k-32k tokens, bf16, causal: TFLOP/s of
   jaxtron's Triton kernel, cuDNN and JAX's own Pallas/Triton attention, with the ratios;
3. training: `python -m jaxtron.bench` on configs/llama-1b.yaml (1.1B parameters, bf16 by
   `model.dtype: auto`): tokens/s, MFU, HFU, compile time and per-device memory;
4. grouped: `python -m jaxtron.kernels.grouped_speed`: the MoE experts' grouped matmul
   (`ragged_dot`, DeepSeek-V3's expert shapes) against a dense batched matmul of the same FLOPs.

The JSON holds each part's results (or its error and the tail of its output), the device and
the versions. The exit status is that of the tests; a part that fails or times out is recorded
and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SEQ_LENS = "1024,2048,4096,8192,16384,32768"
PARTS = ("tests", "kernels", "training", "grouped")
LIMITS_S = {"tests": 360, "kernels": 150, "training": 150, "grouped": 90}


def _run(command: list[str], limit_s: int, env: dict) -> tuple[dict, str]:
    """Run one part; (what to record, its stdout)."""
    start = time.perf_counter()
    record = {"command": " ".join(command)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, env=env)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else ""
        record.update(error=f"timed out after {limit_s} s", output_tail=out[-3000:])
        return record, out
    record.update(returncode=done.returncode, seconds=round(time.perf_counter() - start, 1))
    if done.returncode:
        record.update(error=f"exited {done.returncode}",
                      output_tail=(done.stdout + done.stderr)[-3000:])
    return record, done.stdout


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _test_cases(junit: Path) -> list[dict]:
    cases = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        row = {"test": case.get("name"), "outcome": "passed", "seconds": float(case.get("time", 0))}
        for tag, outcome in (("failure", "failed"), ("error", "errored"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                row.update(outcome=outcome, message=(node.get("message") or "")[:500])
                break
        cases.append(row)
    return cases


def run_tests(env: dict, workdir: Path) -> dict:
    junit = workdir / "gpu_tests.xml"
    junit.unlink(missing_ok=True)  # never report an earlier run's results
    record, _ = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                      "no:cacheprovider", f"--junitxml={junit}", "tests/test_gpu.py"],
                     LIMITS_S["tests"], env)
    if junit.exists():
        cases = _test_cases(junit)
        record.update(cases=cases, **{outcome: sum(c["outcome"] == outcome for c in cases)
                                      for outcome in ("passed", "failed", "errored", "skipped")})
    return record


def run_kernels(env: dict) -> dict:
    record, out = _run([sys.executable, "-m", "jaxtron.kernels.speed", "--seq-lens", SEQ_LENS,
                        "--impls", "cudnn,pallas,jax-triton", "--iters", "5", "--repeats", "2",
                        "--json"], LIMITS_S["kernels"], env)
    record["results"] = _last_json(out)
    record["table"] = out.split("FLOPs:")[0].strip().splitlines()[1:] if out else []
    return record


def run_training(env: dict) -> dict:
    record, out = _run([sys.executable, "-m", "jaxtron.bench", "--config",
                        "configs/llama-1b.yaml", "--warmup", "2", "--steps", "5", "--repeats",
                        "3", "--no-reference", "--json"], LIMITS_S["training"], env)
    record["results"] = _last_json(out)
    return record


def run_grouped(env: dict) -> dict:
    record, out = _run([sys.executable, "-m", "jaxtron.kernels.grouped_speed", "--json"],
                       LIMITS_S["grouped"], env)
    record["results"] = _last_json(out)
    return record


def environment() -> dict:
    from importlib import metadata

    import jax

    devices = jax.devices()
    versions = {}
    for package in ("jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {"device": devices[0].device_kind, "platform": devices[0].platform,
            "device_count": len(devices), "jax": jax.__version__, "versions": versions,
            "python": host.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown --parts {unknown}; choose from {','.join(PARTS)}")
    root = Path(__file__).resolve().parent.parent
    os.chdir(root)  # the tests and configs/ are found from the repository root
    # JAX picks the GPU (an empty JAX_PLATFORMS overrides conftest.py's CPU default); this
    # process only looks at the device, so it must not take the GPU's memory from the parts.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
           "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE")
    out = Path(args.out).resolve()
    report = {"environment": environment()}
    if report["environment"]["platform"] == "cpu":
        print("gpu_check: JAX sees no GPU here; the parts will skip or measure the CPU",
              file=sys.stderr)
    runners = {"tests": lambda: run_tests(env, out.parent), "kernels": lambda: run_kernels(env),
               "training": lambda: run_training(env), "grouped": lambda: run_grouped(env)}
    for part in parts:
        print(f"gpu_check: {part} (limit {LIMITS_S[part]} s) ...", flush=True)
        report[part] = runners[part]()
        out.write_text(json.dumps(report, indent=1))
        print(f"gpu_check: {part}: {report[part].get('error', 'done')} in "
              f"{report[part].get('seconds', '-')} s", flush=True)
    tests = report.get("tests", {})
    print(f"gpu_check: wrote {out}" + (f"; tests passed {tests.get('passed')}, failed "
                                         f"{tests.get('failed')}, skipped {tests.get('skipped')}"
                                         if tests else ""))
    return int(bool(tests.get("error") or tests.get("failed") or tests.get("errored")))


if __name__ == "__main__":
    sys.exit(main())
