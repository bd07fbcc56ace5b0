"""What both halves of asyncsync's own transports share: the trainer side
(``asyncsync/backends``) and the server side (``asyncsync/vllm_plugin``), plus the publish
round's delta encoder (``asyncsync/_publish/delta.py``).

- `wire` — the shm wire types (plain JSON, ``PROTOCOL_VERSION``, ``Manifest``,
  ``ShmFormatError``); imports neither torch nor vLLM.
- `gloo_wire` — the gloo backend's wire types and the ``"gloo"``/``"auto"`` names.
- `delta_codec` — delta payloads (sparse patches, dense, CRC-32; zstd when installed)
  and ``DeltaChainError``.
- `gloo_group` — one generation of a standalone gloo group (polled waits, the abort key,
  the graveyard).
- `trainer_factory` — registers asyncsync's engines in vLLM's
  ``WeightTransferTrainerFactory``.

Private: a package of its own so that neither side reaches into the other's private
modules (tests/test_layers.py). It imports only ``asyncsync._core`` and itself.
"""
