"""PyTorch reference implementations of architecture families transformers does not ship.

Each family lives in its own subpackage as the files a checkpoint carries as remote code
(``configuration_*.py`` and ``modeling_*.py``, loaded through ``config.json`` ``auto_map`` with
``trust_remote_code=True``). The tiny-checkpoint builders copy these files into every test
checkpoint, and the exporter's verification loads them from the checkpoint folder.
"""
