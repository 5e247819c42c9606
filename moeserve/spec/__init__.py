"""Speculative decoding: the accept/reject rule (``rejection``), verification of draft tokens
with the sampler's processing (``verify``) and the MTP draft proposer (``mtp``)."""
