"""End-to-end fault probes of the trainer as a user runs it: real ``python train.py`` processes, killed and
started again, on the tiny config (CPU is enough).

  kill-during-upload  An s3:// run (a moto S3 server on 127.0.0.1, no network) with checkpoint.async_save=true
                      is SIGKILLed while checkpoint step 4 is being uploaded: the server answers the first
                      object of step 4 and holds back the rest, so the kill lands mid-upload every time. The
                      same command then resumes: it quarantines the unfinished step, continues from step 2 and
                      finishes, with one metrics row per step and the killed run's staging folder removed.
  two-trainers        A second trainer started on a live run directory is refused with one line (exit code 2)
                      naming the first (host, pid, since when); the first finishes undisturbed, with exactly one
                      metrics row per logged step.

    python tools/fault_probe_e2e.py [kill-during-upload] [two-trainers] [--workdir DIR]

Each probe raises ProbeFailed with what it saw; the script prints one line per probe and exits 1 on a failure.
tests/tools/test_fault_probe_e2e.py runs both.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(REPO, "data", "embedded")
BUCKET = "mixerlab-probe"
GATED_STEP = 4
STEPS = 6


class ProbeFailed(AssertionError):
    pass


def _check(ok: bool, what: str, output: str = "") -> None:
    if not ok:
        raise ProbeFailed(what + (f"\n--- output ---\n{output[-4000:]}" if output else ""))


def _tiny_args(output_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"train.output_dir={output_dir}",
            f"data.train_path={EMBEDDED}/train", f"data.tokenizer.path={EMBEDDED}/tokenizer.json",
            "train.eval_every=0", "optim.warmup_steps=1", "train.log_every=1", *extra]


def _env(**extra: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------ S3 server
class _UploadGate:
    """WSGI middleware: the first PUT under ``prefix`` goes through, later ones wait until ``open()`` and are
    then refused (the client that sent them has been killed by then); after ``open()`` everything passes."""

    def __init__(self, app, prefix: str):
        self.app, self.prefix = app, prefix
        self.first_object = threading.Event()
        self.release = threading.Event()

    def open(self) -> None:
        self.release.set()

    def __call__(self, environ, start_response):
        if (not self.release.is_set() and environ.get("REQUEST_METHOD") == "PUT"
                and self.prefix in environ.get("PATH_INFO", "")):
            if self.first_object.is_set():
                self.release.wait(timeout=600)
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"held back by the fault probe"]
            response = list(self.app(environ, start_response))
            self.first_object.set()
            return response
        return self.app(environ, start_response)


def _start_s3(prefix: str):
    """(server, gate, environment) of a moto S3 server on 127.0.0.1 whose uploads under ``prefix`` are gated."""
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    gate_holder = {}

    class GatedServer(ThreadedMotoServer):
        def _server_entry(self):
            from moto.moto_server.threaded_moto_server import MotoRequestHandler

            gate = gate_holder["gate"] = _UploadGate(DomainDispatcherApplication(create_backend_app), prefix)
            self._server = make_server(self._ip_address, self._port, gate, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    server = GatedServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "probe",
           "AWS_SECRET_ACCESS_KEY": "probe", "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}
    return server, gate_holder["gate"], env


def _s3fs(env: dict):
    import s3fs

    os.environ.update(env)  # botocore reads the endpoint from the environment
    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem()


# ------------------------------------------------------------------------------------------------ probes
def probe_kill_during_upload(workdir: str) -> str:
    run = f"s3://{BUCKET}/runs/killed"
    server, gate, s3_env = _start_s3(f"/{BUCKET}/runs/killed/checkpoints/{GATED_STEP}/")
    tmp = os.path.join(workdir, "tmp")  # the trainers' TMPDIR: their staging folders can be seen
    os.makedirs(tmp, exist_ok=True)
    env = _env(TMPDIR=tmp, MIXERLAB_STORAGE_CACHE=os.path.join(workdir, "cache"), **s3_env)
    saved = {k: os.environ.get(k) for k in s3_env}
    try:
        fs = _s3fs(s3_env)
        fs.mkdir(BUCKET)
        cmd = _tiny_args(run, f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.async_save=true")
        first_log = open(os.path.join(workdir, "first.log"), "w+")
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=first_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and first.poll() is None and not gate.first_object.wait(0.2):
                pass
            first_log.seek(0)
            _check(gate.first_object.is_set() and first.poll() is None,
                   f"the trainer did not start uploading step {GATED_STEP} (exit code {first.poll()})",
                   first_log.read())
            first.send_signal(signal.SIGKILL)
            first.wait()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
            gate.open()
        fs.invalidate_cache()
        step_dir = f"{BUCKET}/runs/killed/checkpoints/{GATED_STEP}"
        objects = fs.find(step_dir)
        _check(bool(objects) and not any(o.endswith("manifest.mixerlab.json") for o in objects),
               f"after the kill, step {GATED_STEP} should have objects and no manifest: {objects}")
        staged = [n for n in os.listdir(tmp) if n.startswith(f"mixerlab-checkpoints-{first.pid}-")]
        _check(bool(staged), f"no staging folder of the killed trainer in {tmp}: {os.listdir(tmp)}")

        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        out = second.stdout + second.stderr
        _check(second.returncode == 0, f"the resumed run exited with {second.returncode}", out)
        _check(f"checkpoint step {GATED_STEP} in {run}/checkpoints: its upload did not finish" in out,
               f"the unfinished step {GATED_STEP} was not reported", out)
        _check("resuming at step 2" in out, "the resumed run did not continue from step 2", out)
        _check("taking over the lock of a trainer that is no longer running" in out,
               "the killed trainer's lock was not reported as taken over", out)
        fs.invalidate_cache()
        rows = [json.loads(line) for line in fs.cat_file(f"{BUCKET}/runs/killed/metrics.jsonl").decode().splitlines()
                if line.strip()]
        train_steps = [r["step"] for r in rows if r["split"] == "train"]
        _check(train_steps == list(range(1, STEPS + 1)), f"metrics rows of steps {train_steps}", out)
        steps = sorted(int(p.rsplit("/", 1)[1]) for p in fs.ls(f"{BUCKET}/runs/killed/checkpoints"))
        _check(steps[-1] == STEPS and all(fs.exists(f"{BUCKET}/runs/killed/checkpoints/{s}/manifest.mixerlab.json")
                                          for s in steps), f"checkpoints after the resume: {steps}", out)
        _check(fs.exists(f"{BUCKET}/runs/killed/checkpoints.quarantine/{GATED_STEP}.reason.txt"),
               f"step {GATED_STEP} is not in checkpoints.quarantine", out)
        _check(not fs.exists(f"{BUCKET}/runs/killed/mixerlab.lock"), "the lock outlived the finished run", out)
        _check(not any(n.startswith(f"mixerlab-checkpoints-{first.pid}-") for n in os.listdir(tmp)),
               f"the killed trainer's staging folder is still in {tmp}: {os.listdir(tmp)}", out)
        return (f"killed during the upload of step {GATED_STEP} ({len(objects)} of its objects, no manifest); the "
                f"same command quarantined it, resumed at step 2 and finished (checkpoints {steps})")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def probe_two_trainers(workdir: str, steps: int = 200) -> str:
    run = os.path.join(workdir, "shared-run")
    # enough steps that the first trainer is still mid-run when it is frozen, on a fast machine too
    cmd = _tiny_args(run, f"train.steps={steps}", "checkpoint.every=50")
    env = _env(TMPDIR=tempfile.gettempdir())
    first_log = open(os.path.join(workdir, "first-trainer.log"), "w+")
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=first_log, stderr=subprocess.STDOUT)
    metrics = os.path.join(run, "metrics.jsonl")
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None and not (
                os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 1):
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # frozen mid-run (its heartbeat too) while the second one starts
        first_log.seek(0)
        _check(first.poll() is None, f"the first trainer ended before the second started ({first.returncode})",
               first_log.read())
        try:
            second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        finally:
            first.send_signal(signal.SIGCONT)
        err = [line for line in second.stderr.splitlines() if line.strip()]
        _check(second.returncode == 2, f"the second trainer exited with {second.returncode}, not 2",
               second.stdout + second.stderr)
        expected = (f"error: train.output_dir: {run} is in use by another trainer (host {socket.gethostname()}, "
                    f"pid {first.pid}, since ")
        _check(len(err) == 1 and err[0].startswith(expected), f"the second trainer's stderr is not the one line "
               f"{expected!r}...: {err}")
        code = first.wait(timeout=600)
        first_log.seek(0)
        out = first_log.read()
        _check(code == 0, f"the first trainer exited with {code}", out)
        rows = [json.loads(line) for line in open(metrics)]
        train_steps = [r["step"] for r in rows if r["split"] == "train"]
        _check(train_steps == list(range(1, steps + 1)), f"metrics rows of steps {train_steps}", out)
        saved = sorted(int(s) for s in os.listdir(os.path.join(run, "checkpoints")) if s.isdigit())
        _check(saved[-1] == steps and all(s % 50 == 0 for s in saved), f"checkpoints {saved}", out)
        _check(not os.path.exists(os.path.join(run, "mixerlab.lock")), "the lock outlived the finished run", out)
        return f"second trainer refused (exit 2): {err[0]}"
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()


PROBES = {"kill-during-upload": probe_kill_during_upload, "two-trainers": probe_two_trainers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probes", nargs="*", help=f"which probes (default: all of {', '.join(PROBES)})")
    parser.add_argument("--workdir", default=None, help="where runs and logs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.probes) - set(PROBES))
    if unknown:
        parser.error(f"unknown probe(s) {', '.join(unknown)}; choose from {', '.join(PROBES)}")
    failed = 0
    for name in args.probes or list(PROBES):
        workdir = os.path.join(args.workdir, name) if args.workdir else tempfile.mkdtemp(prefix=f"mixerlab-{name}-")
        os.makedirs(workdir, exist_ok=True)
        try:
            print(f"PASS {name}: {PROBES[name](workdir)}", flush=True)
        except ProbeFailed as e:
            failed += 1
            print(f"FAIL {name}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
