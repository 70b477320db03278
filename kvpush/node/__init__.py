"""A node: one TP rank's kvpush, without vLLM (`kvpush.vllm` adapts it to vLLM).

  config    settings (`kv_connector_extra_config` and the environment)
  faults    test hooks, off unless KVPUSH_FAULTS is set
  specs     what vLLM's scheduler decides per request (RecvSpec, SendSpec, AbortSpec)
  results   what the threads report to the engine loop; the hooks' own timing
  context   the frozen `Context` every part gets (settings, identity, transport, Hello)
  loop      the base of the background threads
  layout    prepared block pieces for the fast path
  peers     remote ranks, handshakes, posting and polling transfers (both modes)
  push      prefill, push mode: the writer
  pull      prefill, pull mode: the lease keeper
  receiver  decode, both modes
  worker    the node itself: starts the part its role and mode need, routes messages
"""
