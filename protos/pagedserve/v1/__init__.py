"""pagedserve.v1: generated from the .proto files beside this one by `python protos/generate.py`."""
