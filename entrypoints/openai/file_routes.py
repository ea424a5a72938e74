"""``GET /v1/files/{id}``: a generated file from the file store (see files.py), with a
``Cache-Control`` lifetime of what is left of its TTL."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from .body import BodyRoute
from .dependencies import AUTH, State
from .files import FILE_ID
from .protocol import ApiError

router = APIRouter(prefix="/v1/files", dependencies=[AUTH], route_class=BodyRoute)


@router.get("/{file_id}")
async def get_file(file_id: str, state: State) -> Response:
    found = await state.files.get(file_id) if FILE_ID.fullmatch(file_id) else None
    if found is None:
        shown = file_id if len(file_id) <= 64 else f"{file_id[:64]}... ({len(file_id)} characters)"
        raise ApiError(404, f"file `{shown}` does not exist or has expired", param="file_id", code="not_found")
    media_type, data, left = found
    return Response(data, media_type=media_type, headers={"Cache-Control": f"private, max-age={int(left)}"})
