"""Wire encoding: msgspec Structs round-trip; arrays and tensors travel as raw buffers, no pickle."""

from __future__ import annotations

import functools

import msgspec
import numpy as np
import pytest
from hypothesis import given

from omni_runtime.exceptions import InvalidRequestError, StageDeadError
from omni_runtime.media import ImageItem
from omni_runtime.messages import (
    ErrorInfo,
    Payload,
    StageAbort,
    StageConstraints,
    StageMetrics,
    StageOutput,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
    StageShutdown,
)
from omni_runtime.serialization import (
    INLINE_MAX,
    Encoder,
    check_encodable,
    find_unencodable,
    inbound_decoder,
    outbound_decoder,
)
from tests.strategies import JSON_VALUES


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
        StageReady(
            stage_id=1,
            replica_id=0,
            pid=42,
            constraints=StageConstraints(size_multiple=8, native_size=(64, 64), default_strength={"image": 0.8}),
        ),
        StageOutput(
            request_id="r",
            error=ErrorInfo(type="StageExecutionError", message="boom", stage_id=1),
            payload=Payload(text="hi", metrics=StageMetrics(batch_size=2, extra={"tokens_per_s": 3.5})),
        ),
        StageRpcResult(call_id=3, result={"ok": [1, 2]}),
    ],
)
def test_outbound_messages_roundtrip(msg):
    assert roundtrip(msg, outbound_decoder())[0] == msg


def test_arrays_and_tensors_travel_as_raw_frames():
    import torch

    image = (np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)
    latents = torch.randn(2, 4, 8, 8)
    half = torch.randn(32, 32).to(torch.bfloat16)
    small = np.float32([1.5, 2.5])
    msg = StageOutput(
        request_id="r",
        payload=Payload(
            media=[ImageItem(data=image, seed=7)], tensors={"latents": latents, "bf": half, "small": small}
        ),
    )
    out, frames = roundtrip(msg, outbound_decoder())
    # Header + one frame per large array; the small one is inlined.
    assert len(frames) == 1 + 3
    assert small.nbytes < INLINE_MAX
    (item,) = out.payload.media
    assert isinstance(item, ImageItem) and item.seed == 7 and (item.width, item.height) == (64, 64)
    assert item.data.dtype == np.uint8 and np.array_equal(item.data, image)
    assert isinstance(out.payload.tensors["latents"], torch.Tensor) and torch.equal(
        out.payload.tensors["latents"], latents
    )
    assert out.payload.tensors["bf"].dtype == torch.bfloat16 and torch.equal(out.payload.tensors["bf"], half)
    assert isinstance(out.payload.tensors["small"], np.ndarray) and np.array_equal(out.payload.tensors["small"], small)
    # The large frame is the array's own memory, not a copy inside the header.
    assert len(frames[0]) < 1024


def test_unsupported_objects_are_refused_not_pickled():
    with pytest.raises(msgspec.EncodeError, match="cannot send objects of type object"):
        Encoder().encode(StageRpcResult(call_id=1, result=object()))


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (StageRequest(request_id="r", prompt="a\ud800b", params={}), "UnicodeEncodeError"),
        (StageRpc(call_id=1, method="set_batching", kwargs={"max_num_seqs": 10**30}), "OverflowError"),
        (StageOutput(request_id="r", payload=Payload(metrics=StageMetrics(extra={"n": -(2**64)}))), "OverflowError"),
    ],
)
def test_what_msgpack_cannot_carry_is_one_typed_encode_error(msg, why):
    with pytest.raises(msgspec.EncodeError, match=why):
        Encoder().encode(msg)


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


@given(JSON_VALUES)
def test_find_unencodable_agrees_with_the_encoder(value):
    """The check made at every entry point says exactly what the wire encoder will refuse."""
    found = find_unencodable(value, "v")
    try:
        Encoder().encode(StageRpc(call_id=1, method="m", args=[value]))
    except msgspec.EncodeError:
        assert found is not None
    else:
        assert found is None
    if found is not None:
        with pytest.raises(InvalidRequestError) as err:
            check_encodable(value, "v")
        assert err.value.param == found[0] and err.value.param.startswith("v")


def test_find_unencodable_names_the_path_and_the_reason():
    import torch

    assert find_unencodable({"a": [1, {"b": "x\udfffy"}]}, "kwargs") == (
        "kwargs.a[1].b",
        "contains U+DFFF at index 1, which cannot be encoded as UTF-8",
    )
    path, why = find_unencodable([2**64], "args")
    assert path == "args[0]" and "out of range" in why
    path, why = find_unencodable(functools.reduce(lambda v, _: [v], range(40), 0), "deep")
    assert "nested deeper" in why
    assert find_unencodable({"t": torch.zeros(3), "a": np.zeros(2), "b": b"raw"}, "ok") is None
    assert "Python objects" in find_unencodable(np.array([object()]), "x")[1]
