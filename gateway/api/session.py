"""Who the caller is (``GET /me``): the console signs in with it and shows the buttons the
role allows."""

from __future__ import annotations

from typing import Final, Literal, cast

import msgspec

from gateway.api.auth import CallDep, Role
from gateway.api.routes import route

TAG: Final = "session"
RoleName = Literal["viewer", "operator", "admin"]


class Me(msgspec.Struct, kw_only=True):
    """The token's configured name (the audit's actor for whatever it does) and role."""

    name: str
    role: RoleName


@route(
    "GET",
    "/me",
    summary="The calling token's name and role",
    operation_id="getMe",
    tag=TAG,
    role=Role.VIEWER,
    description=(
        "The name is what the audit trail records as the actor of every change this token "
        "makes; the role says which operations it may call."
    ),
)
async def me(call: CallDep) -> Me:
    # Role's three members' labels are exactly the Literal's values.
    role = cast("RoleName", call.caller.role.label)
    return Me(name=call.caller.name, role=role)


HANDLERS: Final = [me]
