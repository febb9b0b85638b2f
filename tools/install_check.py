"""Installs a freshly built ucm wheel into a new virtual environment outside
the checkout and uses it as a newcomer would: a store round trip, `ucm
serve` with a tiny model, two requests (the second loads from the store), a
restart (the first request after it loads from the store too), then `ucm
store info` and `ucm store verify`.

vLLM and torch come from the checkout's `.venv` (its site-packages is added
to the new environment's path): vLLM's CPU build can't be installed by pip
from its own requirements (see requirements-vllm.txt), and a second copy of
torch would cost gigabytes. Everything of ucm itself comes from the wheel.
Built with the dist profile (what ships, the default), its extension must be
stripped: no debug info, no symbol table.

    python tools/install_check.py [--keep] [--profile release] [--features F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support.elf import section_names
from support.tiny_serve import free_port, http, tiny_server_args

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / ".venv"
#: Sections a stripped extension has none of: debug info and the symbol table.
UNSTRIPPED = {".debug_info", ".debug_line", ".symtab"}


def sh(*cmd: str | Path, **kw) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def loaded_blocks(base: str) -> float:
    text = http(base + "/metrics", timeout=120)[1]
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("ucm_load_blocks_total")
    )


class Server:
    """`ucm serve` from the new environment, on a free port."""

    def __init__(self, ucm: Path, model: Path, store: Path, log: Path, cwd: Path) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        port = self.base.rsplit(":", 1)[1]
        self.log = log
        self.proc = subprocess.Popen(
            [
                str(ucm),
                "serve",
                str(model),
                "--storage",
                str(store),
                *tiny_server_args(int(port)),
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        deadline = time.time() + 300
        while http(self.base + "/health", timeout=120)[0] != 200:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise SystemExit(f"ucm serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)

    def complete(self, prompt: str) -> dict:
        status, body = http(
            self.base + "/v1/completions",
            {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        if status != 200:
            raise SystemExit(f"completion failed ({status}): {body}")
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument(
        "--profile",
        default="dist",
        help=(
            "Cargo profile of the wheel: dist (what ships) or release (reuses the build "
            "tools/setup.sh made, instead of compiling every dependency again)"
        ),
    )
    ap.add_argument(
        "--features",
        default="",
        help="Cargo features of the wheel (the tests pass setup.sh's own, to reuse its build)",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ucm-install-check-"))
    try:
        sh(
            DEV / "bin" / "maturin",
            "build",
            "--profile",
            args.profile,
            "-q",
            *(["--features", args.features] if args.features else []),
            "-o",
            work / "dist",
            cwd=ROOT,
        )
        (wheel,) = (work / "dist").glob("ucm_kvcache-*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (native,) = [n for n in whl.namelist() if n.endswith("_native.abi3.so")]
            native_bytes = whl.read(native)
        debug = sorted(n for n in section_names(native_bytes) if n in UNSTRIPPED)
        print(
            f"wheel {wheel.name}: native module {len(native_bytes) / 1e6:.1f} MB, "
            + (f"not stripped ({', '.join(debug)})" if debug else "stripped")
        )
        if debug and args.profile == "dist":
            raise SystemExit(f"the dist profile shipped an unstripped extension: {debug}")
        venv = work / "venv"
        sh(sys.executable, "-m", "venv", venv)
        py, ucm = venv / "bin" / "python", venv / "bin" / "ucm"
        sh(py, "-m", "pip", "install", "-q", wheel)
        dev_site = next((DEV / "lib").glob("python3*/site-packages"))
        site = next((venv / "lib").glob("python3*/site-packages"))
        (site / "zz-vllm-from-checkout.pth").write_text(f"{dev_site}\n")
        run = work / "run"
        run.mkdir()
        where = sh(py, "-c", "import ucm; print(ucm.__file__)", cwd=run, capture_output=True)
        if not where.stdout.strip().startswith(str(venv)):
            raise SystemExit(f"ucm was not imported from the wheel: {where.stdout}")
        sh(
            py,
            "-c",
            (
                "import numpy as np; import ucm.store\n"
                "s = ucm.store.open({'storage_backends': "
                f"{str(run / 'kv-test')!r}, 'block_size': 4096}})\n"
                "a = np.arange(4096, dtype=np.uint8); b = np.zeros_like(a)\n"
                "s.wait(s.dump([b'k' * 16], [0], [[a]])); s.wait(s.load([b'k' * 16], [0], [[b]]))\n"
                "assert (a == b).all(); s.close(); print('store round trip ok')"
            ),
            cwd=run,
        )
        sh(ucm, "--help", cwd=run, capture_output=True)
        version = sh(ucm, "--version", cwd=run, capture_output=True).stdout
        if not version.startswith("ucm-kvcache "):
            raise SystemExit(f"ucm --version names no ucm-kvcache: {version!r}")
        model = Path(
            sh(
                py, "-m", "ucm.vllm_demo.tiny_model", work / "model", cwd=run, capture_output=True
            ).stdout.strip()
        )
        store = work / "store"
        prompt = " ".join(f"word{i % 97}" for i in range(200))
        server = Server(ucm, model, store, work / "serve1.log", run)
        try:
            first = server.complete(prompt)
            time.sleep(1.0)  # the save completes asynchronously
            second = server.complete(prompt)
            if loaded_blocks(server.base) <= 0:
                raise SystemExit("the second request loaded nothing from the store")
        finally:
            server.stop()
        server = Server(ucm, model, store, work / "serve2.log", run)
        try:
            third = server.complete(prompt)
            if loaded_blocks(server.base) <= 0:
                raise SystemExit("after the restart, the request loaded nothing from the store")
        finally:
            server.stop()
        texts = {r["choices"][0]["text"] for r in (first, second, third)}
        if len(texts) != 1:
            raise SystemExit(f"tokens differ between cold and loaded runs: {texts}")
        info = sh(ucm, "store", "info", "--dir", store, cwd=run, capture_output=True).stdout
        print(info)
        verify = sh(ucm, "store", "verify", "--dir", store, cwd=run, capture_output=True)
        print(verify.stdout)
        print("install check: ok")
        return 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
