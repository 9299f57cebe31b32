"""Generate the `kvcache_proto` package from `proto/` (the one command for it).

Usage:
    python scripts/gen_proto.py           # rewrite kvcache_proto/ in place
    python scripts/gen_proto.py --check   # exit 1 if kvcache_proto/ is stale

protoc writes `kvcache/v1/kvcache_pb2.py` with imports rooted at `kvcache.v1`;
this script flattens the output into the `kvcache_proto` package and rewrites
those imports, so the generated code lives in a package of its own. The
output depends only on `proto/` and the pinned grpcio-tools version.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "kvcache/v1/kvcache.proto"
OUT_PACKAGE = ROOT / "kvcache_proto"
GENERATED = ("kvcache_pb2.py", "kvcache_pb2.pyi", "kvcache_pb2_grpc.py")
INIT = '"""Generated protobuf and gRPC code for kvcache.v1 (see scripts/gen_proto.py)."""\n'


def generate() -> dict[str, str]:
    """Runs protoc and returns {file name: content} of the package."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out: dict[str, str] = {"__init__.py": INIT}
        for name in GENERATED:
            text = (Path(tmp) / "kvcache" / "v1" / name).read_text()
            text = text.replace("from kvcache.v1 import", "from kvcache_proto import")
            out[name] = text
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if kvcache_proto/ is stale")
    args = parser.parse_args()
    files = generate()
    stale = []
    for name, text in files.items():
        path = OUT_PACKAGE / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            stale.append(name)
            if args.check:
                diff = difflib.unified_diff(
                    current.splitlines(), text.splitlines(), str(path), "regenerated", lineterm=""
                )
                print("\n".join(list(diff)[:40]))
            else:
                OUT_PACKAGE.mkdir(exist_ok=True)
                path.write_text(text)
    if args.check and stale:
        print(f"kvcache_proto is stale ({', '.join(stale)}): run python scripts/gen_proto.py")
        return 1
    print("kvcache_proto is up to date" if not stale else f"regenerated {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
