"""Stock SGLang on a machine without a GPU: the environment its CPU engine
needs (shim.py) and the plain-PyTorch operators of its CPU speculative, MLA,
gpt-oss and tensor-parallel paths (spec_ops.py; DFlash's in dflash.py), a prompt SIGTERM stop
(shutdown.py), loaded into the server's processes by
sglang_site/sitecustomize.py. Nothing here is used on a GPU."""
