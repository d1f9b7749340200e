"""Regenerates the gRPC Python modules from `colocar.proto` (a test keeps them in sync).

Run `python -m colocar.protocol.generate` after editing the .proto file; needs grpcio-tools.
"""

from __future__ import annotations

import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent


def generate(out_dir: pathlib.Path = HERE) -> list[pathlib.Path]:
    """Writes colocar_pb2.py(i) and colocar_pb2_grpc.py into out_dir and returns their paths."""
    from grpc_tools import protoc

    rc = protoc.main(
        [
            "protoc",
            f"-I{HERE}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(HERE / "colocar.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_module = out_dir / "colocar_pb2_grpc.py"
    # protoc writes an absolute import; make it package-relative.
    text = grpc_module.read_text()
    text = re.sub(r"^import colocar_pb2 as", "from . import colocar_pb2 as", text, flags=re.M)
    grpc_module.write_text(text)
    return [out_dir / "colocar_pb2.py", out_dir / "colocar_pb2.pyi", grpc_module]


if __name__ == "__main__":
    for path in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
