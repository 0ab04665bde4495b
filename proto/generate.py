"""Generates the Python stubs of proto/gqa/v1 (run by `make proto`) into both packages that
carry a copy: the server's `service/api` and the Python client's `clients/python/gqa_client/api`
(the client is a distribution of its own and imports nothing of the server).

The stubs are committed; tests/test_proto.py regenerates them into a scratch folder and fails
on any drift of either copy, so they are never edited by hand. grpc_tools writes
`from gqa.v1 import gqa_pb2`; the import is made relative so the stubs live inside the `api`
package of each.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent
PROTOS = ["gqa/v1/gqa.proto"]
# Every committed copy of the stubs (each folder also holds a hand-written __init__.py).
OUT_DIRS = [ROOT.parent / "service" / "api", ROOT.parent / "clients" / "python" / "gqa_client" / "api"]


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for proto in PROTOS:
            stem = pathlib.Path(proto).with_suffix("")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                src = pathlib.Path(tmp) / f"{stem}{suffix}"
                text = src.read_text()
                text = text.replace("from gqa.v1 import", "from . import")
                dst = out_dir / src.name
                dst.write_text(text)
                written.append(dst)
    # The .proto travels with the package so that tools and other languages can find it.
    for proto in PROTOS:
        shutil.copyfile(ROOT / proto, out_dir / pathlib.Path(proto).name)
        written.append(out_dir / pathlib.Path(proto).name)
    return written


if __name__ == "__main__":
    for out in [pathlib.Path(arg) for arg in sys.argv[1:]] or OUT_DIRS:
        for path in generate(out):
            print(path)
