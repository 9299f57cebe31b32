"""A user's script importing the public paths passes ``mypy --strict`` (and pyright, where installed).

The SDK is installed the way the README says (``pip install -e . --config-settings editable_mode=strict``)
into a fresh venv, so the check also covers what an install ships: ``py.typed`` in every package and a
layout a static checker can follow (setuptools' default editable finder is an import hook that mypy and
pyright cannot see, because ``client/`` and ``connectors/`` are mapped with ``package-dir``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = textwrap.dedent(
    """
    import kvcache_client
    import kvcache_connectors
    import kvcache_proto
    from kvcache_client import KVCacheClient
    from kvcache_client.format import DType, Layout
    from kvcache_proto import kvcache_pb2

    def describe(dtype: DType, layout: Layout) -> str:
        return f"{dtype.name}/{layout.name}"

    client_type: type[KVCacheClient] = KVCacheClient
    request = kvcache_pb2.LookupRequest()
    print(describe(next(iter(DType)), next(iter(Layout))), client_type, request)
    print(kvcache_client.__name__, kvcache_connectors.__name__, kvcache_proto.__name__)
    """
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only the SDK, installed editable as the README says; its deps come from ours."""
    venv = tmp_path_factory.mktemp("typing") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    )
    # numpy, grpc and protobuf for the checker, from this venv (a .pth dir, as mypy reads them).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(ROOT),
            "--config-settings",
            "editable_mode=strict",
        ],
        check=True,
        timeout=300,
        cwd=ROOT,
    )
    return python


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    return script


@pytest.mark.timeout(300)
def test_mypy_strict_sees_the_public_paths(installed: Path, tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--python-executable",
            str(installed),
            str(_script(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_pyright_strict_sees_the_public_paths(installed: Path, tmp_path: Path) -> None:
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if pyright is None:
        pytest.skip("pyright is not installed (the dev extra has it)")
    script = _script(tmp_path)
    (tmp_path / "pyrightconfig.json").write_text('{"typeCheckingMode": "strict"}')
    out = subprocess.run(
        [pyright, "--pythonpath", str(installed), str(script)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
