"""Wire encoding: msgspec Structs round-trip; arrays and tensors travel as raw buffers, no pickle."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.exceptions import StageDeadError
from omni_runtime.messages import (
    ErrorInfo,
    StageAbort,
    StageOutput,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
    StageShutdown,
)
from omni_runtime.serialization import INLINE_MAX, Encoder, inbound_decoder, outbound_decoder

pytestmark = pytest.mark.unit


def roundtrip(msg, decoder):
    frames = Encoder().encode(msg)
    # Frames arrive as separate buffers, as from a socket.
    return decoder.decode([bytes(f) for f in frames]), frames


@pytest.mark.parametrize(
    "msg",
    [
        StageRequest(request_id="r1", prompt="a cat", params={"seed": 3, "guidance_scale": 7.5}),
        StageAbort(request_ids=["a", "b"]),
        StageRpc(call_id=4, method="set_batching", kwargs={"max_num_seqs": 2}),
        StageShutdown(),
    ],
)
def test_inbound_messages_roundtrip(msg):
    assert roundtrip(msg, inbound_decoder())[0] == msg


@pytest.mark.parametrize(
    "msg",
    [
        StageReady(stage_id=1, replica_id=0, pid=42, constraints={"size_multiple": 8}),
        StageOutput(
            request_id="r",
            text="hi",
            metrics={"batch_size": 2},
            error=ErrorInfo(type="StageExecutionError", message="boom", stage_id=1),
        ),
        StageRpcResult(call_id=3, result={"ok": [1, 2]}),
    ],
)
def test_outbound_messages_roundtrip(msg):
    assert roundtrip(msg, outbound_decoder())[0] == msg


def test_arrays_and_tensors_travel_as_raw_frames():
    image = (np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)
    latents = torch.randn(2, 4, 8, 8)
    half = torch.randn(32, 32).to(torch.bfloat16)
    small = np.float32([1.5, 2.5])
    msg = StageOutput(request_id="r", images=[image], tensors={"latents": latents, "bf": half, "small": small})
    out, frames = roundtrip(msg, outbound_decoder())
    # Header + one frame per large array; the small one is inlined.
    assert len(frames) == 1 + 3
    assert small.nbytes < INLINE_MAX
    assert out.images[0].dtype == np.uint8 and np.array_equal(out.images[0], image)
    assert isinstance(out.tensors["latents"], torch.Tensor) and torch.equal(out.tensors["latents"], latents)
    assert out.tensors["bf"].dtype == torch.bfloat16 and torch.equal(out.tensors["bf"], half)
    assert isinstance(out.tensors["small"], np.ndarray) and np.array_equal(out.tensors["small"], small)
    # The large frame is the array's own memory, not a copy inside the header.
    assert len(frames[0]) < 1024


def test_unsupported_objects_are_refused_not_pickled():
    with pytest.raises(NotImplementedError, match="cannot send objects of type object"):
        Encoder().encode(StageRpcResult(call_id=1, result=object()))


@pytest.mark.parametrize("frames", [[b"garbage"], [], [b"\x81\xa4type\xa5nope!"], Encoder().encode(StageShutdown())])
def test_malformed_or_foreign_frames_raise_decode_error(frames):
    with pytest.raises(msgspec.DecodeError):
        outbound_decoder().decode(frames)


def test_error_info_recreates_typed_errors():
    info = ErrorInfo.from_exception(StageDeadError("gone", stage_id=2))
    err = info.to_exception()
    assert isinstance(err, StageDeadError) and err.stage_id == 2 and str(err) == "gone"
    other = ErrorInfo.from_exception(ZeroDivisionError("x"), stage_id=1).to_exception()
    assert type(other).__name__ == "StageExecutionError" and "ZeroDivisionError" in str(other)
