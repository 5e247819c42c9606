"""Prefill/decode disaggregation: a request's prompt runs on a prefill instance, its KV blocks
move into a decode instance's pool through the Mooncake Transfer Engine, and the decode
instance produces every output token (``docs/disaggregation.md``)."""
