"""GET /alarms/groups in a storm over more devices (or rules) than one answer holds: the
groups beyond `limit` were dropped with nothing saying so, and no request could reach them.
The list is paged as every list is (`next_before`, worst first then newest), each group once.
Real HTTP against real PostgreSQL."""

from __future__ import annotations

from tests.integration.api.test_alarm_desk_audit import Api, api

__all__ = ["api"]


async def test_groups_beyond_the_limit_are_reached_through_next_before(api: Api) -> None:
    raised = {f"site-{n}": await api.raise_alarm(f"site-{n}", rule="silent") for n in range(5)}
    await api.raise_alarm("site-1", rule="silent")  # a group of two
    first = await api.get("/alarms/groups?by=device&open=true&limit=2")
    assert first.status == 200, first.body
    assert len(first.body["items"]) == 2
    assert first.body.get("next_before") is not None  # three more groups exist
    keys = [g["key"] for g in first.body["items"]]
    cursor = first.body["next_before"]
    pages = 1
    while cursor is not None:
        page = await api.get(f"/alarms/groups?by=device&open=true&limit=2&before={cursor}")
        assert page.status == 200, page.body
        keys += [g["key"] for g in page.body["items"]]
        cursor = page.body["next_before"]
        pages += 1
    assert pages == 3
    assert sorted(keys) == sorted(raised)  # each group once
    # Newest first within one severity: as one answer would order them.
    whole = await api.get("/alarms/groups?by=device&open=true&limit=500")
    assert [g["key"] for g in whole.body["items"]] == keys
    assert whole.body["next_before"] is None
    for bad in ("x", "5:1", "0:1", "3:0", "3:99999999999999999999", "3"):
        refused = await api.get(f"/alarms/groups?by=device&before={bad}")
        assert (refused.status, refused.body["error"]) == (400, "BAD_REQUEST"), bad
