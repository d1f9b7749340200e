"""The wire protocol shared by controller and sidecar: messages, serialization, versions.

Generated modules (`colocar_pb2*.py`) come from `colocar.proto` via `generate.py`.
"""
