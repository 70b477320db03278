"""kvpush: fast, safe KV-cache handoff for prefill/decode disaggregated vLLM serving."""

# The package version, written only here: pyproject.toml reads it for the wheel's metadata
# (`[tool.setuptools.dynamic]`) and `kvpush --version` prints it.
__version__ = "0.1.0"
