"""Flyte 2 declarations accepted as written: flyteidl2 enqueue messages to engine actions.

Needs the optional extra: ``pip install 'leasehold[flyte]'`` (the flyte SDK and its pinned
flyteidl2). The mapping, what is accepted and what is refused, is docs/flyte.md.

    from engine.flyte import enqueue_flyte, flyte_action

    enqueue_flyte(eng, request_bytes)                 # decode and enqueue, inputs included
    eng.enqueue(flyte_action(request).spec)           # the spec alone
"""

try:
    from engine._flyte import (
        ACCELERATOR_MODELS,
        FlyteAction,
        FlyteFanOut,
        decode_request,
        enqueue_fanouts,
        enqueue_flyte,
        flyte_action,
        flyte_fanouts,
        flyte_task_action,
    )
except ImportError as exc:  # flyteidl2 (or protobuf) missing: say which extra brings it
    raise ImportError(f"engine.flyte needs the flyte extra: pip install 'leasehold[flyte]' "
                      f"({exc})") from exc

__all__ = [
    "ACCELERATOR_MODELS",
    "FlyteAction",
    "FlyteFanOut",
    "decode_request",
    "enqueue_fanouts",
    "enqueue_flyte",
    "flyte_action",
    "flyte_fanouts",
    "flyte_task_action",
]
