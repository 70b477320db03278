"""The data plane: NIXL transfers and the TCP control channel (threads and sockets live here).

Nothing in this package imports vLLM; the vLLM adapter uses it, and so can tests and tools.
"""
