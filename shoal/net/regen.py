"""Regenerate ``shoal_pb2.py`` / ``shoal_pb2_grpc.py`` from ``shoal.proto`` (dev only).

Run ``.venv/bin/python -m shoal.net.regen`` after editing the schema and commit the
generated files; the runtime itself needs only ``protobuf`` and ``grpcio``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main() -> int:
    """Run grpc_tools.protoc on shoal.proto and make the gRPC module import relative."""
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{here}", f"--python_out={here}", f"--grpc_python_out={here}",
        f"--pyi_out={here}", str(here / "shoal.proto"),
    ])
    if rc:
        return rc
    grpc_mod = here / "shoal_pb2_grpc.py"
    text = grpc_mod.read_text()
    # protoc writes an absolute import that only works with shoal/net on sys.path.
    text = re.sub(r"^import shoal_pb2 as shoal__pb2$", "from shoal.net import shoal_pb2 as shoal__pb2",
                  text, flags=re.M)
    grpc_mod.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
