"""kvpush: fast, safe KV-cache handoff for prefill/decode disaggregated vLLM serving."""

__version__ = "0.1.0"
