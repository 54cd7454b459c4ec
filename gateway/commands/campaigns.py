"""Campaigns (behaviour §7): one request commanding many devices, as an aggregate of its own.

Creation resolves the targets (a list of ids, or the rules' device selector against the known
bound devices), stores the resolved list, and inserts every command in one statement, all in
the request's transaction. A campaign closes once, by a conditional write on status RUNNING
with its audit row and outbox event: COMPLETED or ABORTED by the settler (every node runs
one; PostgreSQL wakes them when a campaign's command turns terminal), CANCELLED by an
operator. The settler locks the campaign row before counting its commands, so of several nodes
judging the same campaign the later ones count what the earlier ones committed: the abort
happens exactly once, and a campaign whose last commands finish on different nodes at once
still completes.

The rollout limit is enforced by the dispatchers' claim statement (storage/queries/commands.sql).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import asyncpg
import msgspec
import structlog

from gateway.commands.creator import confirmed_transaction
from gateway.commands.lifecycle import command_to_json
from gateway.domain.campaign import AbortCriteria, CampaignError, CampaignStatus, settle
from gateway.domain.command import CommandStatus, Delivery
from gateway.domain.rules import DeviceSelector
from gateway.support.loops import drain_on_notify
from gateway.support.metrics import Metrics
from protocol import events
from storage import campaigns as repo
from storage import outbox
from storage.campaigns import CampaignRow, CountedCampaignRow
from storage.commands import CommandRow, MovedCommandRow
from storage.pool import bound_lock_wait

log = structlog.get_logger(__name__)

AGGREGATE: Final = events.Aggregate.CAMPAIGN
EVENT_CLOSED: Final = {
    CampaignStatus.COMPLETED: events.EventType.CAMPAIGN_COMPLETED,
    CampaignStatus.ABORTED: events.EventType.CAMPAIGN_ABORTED,
    CampaignStatus.CANCELLED: events.EventType.CAMPAIGN_CANCELLED,
}
SETTLER_ACTOR: Final = "system:campaigns"
NOTIFY_CHANNEL: Final = "campaign_settle"
COMMAND_AGGREGATE: Final = events.Aggregate.COMMAND
# A campaign this large refreshes the command table's statistics once it is committed: it is a
# bulk load, and claims planned from statistics that have not seen it scan every pending row.
ANALYZE_AFTER_COMMANDS: Final = 1000
ANALYZE_LOCK_TIMEOUT_S: Final = 2.0


class CampaignNotFoundError(CampaignError):
    code = "NOT_FOUND"

    def __init__(self, campaign_id: int) -> None:
        super().__init__(f"no campaign {campaign_id}")
        self.campaign_id = campaign_id


class CampaignClosedError(CampaignError):
    code = "ILLEGAL_TRANSITION"

    def __init__(self, campaign_id: int, status: str) -> None:
        super().__init__(f"campaign {campaign_id} is {status}: it cannot be cancelled")
        self.campaign_id = campaign_id
        self.status = status


class CampaignChangedError(CampaignError):
    """The cancel read the campaign RUNNING, and its conditional write found it closed: the
    settler (completed, aborted) or another operator closed it first (HTTP 409)."""

    code = "STATUS_CHANGED"

    def __init__(self, campaign_id: int, status: str, actor: str | None) -> None:
        by = f" by {actor}" if actor else ""
        super().__init__(f"campaign {campaign_id} changed meanwhile: already {status}{by}")
        self.campaign_id = campaign_id
        self.status = status
        self.actor = actor


class UnboundTargetsError(CampaignError):
    code = "DEVICE_UNBOUND"

    def __init__(self, device_ids: Sequence[str]) -> None:
        shown = ", ".join(device_ids[:20]) + (" …" if len(device_ids) > 20 else "")
        super().__init__(
            f"{len(device_ids)} target device(s) are unbound and take no commands: {shown}"
        )
        self.device_ids = list(device_ids)


class NoTargetsError(CampaignError):
    code = "NO_TARGETS"

    def __init__(self) -> None:
        super().__init__("the targets name no device that takes commands")


@dataclass(frozen=True, slots=True)
class Targets:
    """Either explicit device ids or a selector's patterns (validated by the caller)."""

    devices: tuple[str, ...] | None = None
    selector: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class CampaignRequest:
    name: str
    params: dict[str, Any]
    delivery: Delivery
    targets: Targets
    per_minute: int | None
    abort: AbortCriteria | None
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class CampaignCreation:
    campaign: CountedCampaignRow
    created: bool


def campaign_to_json(row: CampaignRow) -> dict[str, Any]:
    """An event's view of the campaign: everything but the (possibly long) device list."""
    body = {
        k: v
        for k, v in msgspec.structs.asdict(row).items()
        if k not in {"device_ids", "rollout_tokens", "counts"}
    }
    body["total"] = len(row.device_ids)
    converted: dict[str, Any] = msgspec.to_builtins(body)
    return converted


def counts_of(row: CountedCampaignRow) -> dict[str, int]:
    """Every command status with its count (zero when none), from a row read by ``repo.get``."""
    found = row.counts
    return {status.value: int(found.get(status.value, 0)) for status in CommandStatus}


async def _resolve(conn: asyncpg.Connection, targets: Targets, *, lock: bool = True) -> list[str]:
    # The known targets stay locked until the campaign commits: an unbind racing it waits,
    # then cancels the commands made here; one committed first is read here (repo.lock_targets).
    if targets.devices is not None:
        devices = list(dict.fromkeys(targets.devices))  # the first mention's order
        bound = await repo.lock_targets(conn, devices)
        unbound = sorted(d for d, is_bound in bound.items() if not is_bound)
        if unbound:
            raise UnboundTargetsError(unbound)
    else:
        assert targets.selector is not None
        selector = DeviceSelector(targets.selector)
        devices = [d for d in await repo.bound_devices(conn) if selector.matches(d)]
        if lock:
            bound = await repo.lock_targets(conn, devices)
            devices = [d for d in devices if bound.get(d, False)]  # unbound since the read
    if not devices:
        raise NoTargetsError
    return devices


async def _closed(
    conn: asyncpg.Connection,
    campaign_id: int,
    *,
    status: CampaignStatus,
    reason: str,
    actor: str,
    action: str,
    node_id: str,
    request_id: str | None,
) -> tuple[CountedCampaignRow, list[MovedCommandRow]] | None:
    """RUNNING → ``status`` once, with audit, event and (unless COMPLETED) its open commands
    cancelled with theirs; None when it was not RUNNING any more (nothing changed)."""
    closed = await repo.close(
        conn,
        campaign_id,
        status=status.value,
        reason=reason,
        actor=actor,
        action=action,
        node_id=node_id,
        request_id=request_id,
    )
    if closed is None:
        return None
    cancelled: list[MovedCommandRow] = []
    if status is not CampaignStatus.COMPLETED:
        cancelled = await repo.cancel_open_commands(
            conn, campaign_id, actor=actor, action=f"campaign-{action}", node_id=node_id
        )
        if cancelled:
            await outbox.add_events(
                conn,
                aggregate_type=COMMAND_AGGREGATE,
                event_type=events.EventType.COMMAND_FINISHED,
                events=[
                    (str(r.id), events.CommandFinished(command=command_to_json(r), actor=actor))
                    for r in cancelled
                ],
            )
    row = await repo.get(conn, campaign_id)
    assert row is not None
    await outbox.add_event(
        conn,
        aggregate_type=AGGREGATE,
        aggregate_id=str(campaign_id),
        event_type=EVENT_CLOSED[status],
        payload=events.CampaignClosed(
            campaign=campaign_to_json(row), counts=counts_of(row), actor=actor
        ),
    )
    return row, cancelled


# Raises for what the broker could never carry of a command to these devices: the command
# path's own check (CommandService.refuse_unsendable), which sits a layer above campaigns.
RefuseUnsendable = Callable[[Sequence[str], str, dict[str, Any]], None]


class CampaignService:
    """Campaigns for the API and the settler: each call one transaction on a pooled connection.

    ``refuse_unsendable``: checks the resolved targets before anything is created (the API
    passes the command path's check, so a campaign is refused what a command would be)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        expire_after_s: float,
        *,
        metrics: Metrics | None = None,
        refuse_unsendable: RefuseUnsendable | None = None,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.expire_after_s = expire_after_s
        self.metrics = metrics
        self.refuse_unsendable = refuse_unsendable

    async def create(
        self, request: CampaignRequest, *, actor: str, request_id: str | None = None
    ) -> CampaignCreation:
        async def create(conn: asyncpg.Connection) -> tuple[CampaignCreation, int]:
            return await self._create(conn, request, actor=actor, request_id=request_id)

        # Lost after the COMMIT was sent, the campaign may exist, its commands going out:
        # "nothing written, retry" would have it created twice.
        creation, commands = await confirmed_transaction(
            self.pool, create, what="campaign", wrote=lambda made: made[0].created
        )
        if creation.created and commands >= ANALYZE_AFTER_COMMANDS:
            await self._analyze(campaign_id=creation.campaign.id, commands=commands)
        return creation

    async def _create(
        self,
        conn: asyncpg.Connection,
        request: CampaignRequest,
        *,
        actor: str,
        request_id: str | None,
    ) -> tuple[CampaignCreation, int]:
        """In the caller's transaction: the campaign (or the one holding its key), and how
        many commands were created for it."""
        if request.idempotency_key is not None:
            existing = await repo.by_idempotency_key(conn, request.idempotency_key)
            if existing is not None:
                return CampaignCreation(await self._read(conn, existing.id), created=False), 0
        devices = await _resolve(conn, request.targets)
        if self.refuse_unsendable is not None:  # before any insert: nothing is created
            self.refuse_unsendable(devices, request.name, request.params)
        abort = request.abort
        row = await repo.insert(
            conn,
            name=request.name,
            params=request.params,
            delivery=request.delivery.value,
            target_devices=request.targets.devices,
            target_selector=request.targets.selector,
            device_ids=devices,
            per_minute=request.per_minute,
            failure_ratio=None if abort is None else abort.failure_ratio,
            min_finished=None if abort is None else abort.min_finished,
            idempotency_key=request.idempotency_key,
            created_by=actor,
        )
        if row is None:  # a concurrent request with the same key committed first
            assert request.idempotency_key is not None
            existing = await repo.by_idempotency_key(conn, request.idempotency_key)
            assert existing is not None
            return CampaignCreation(await self._read(conn, existing.id), created=False), 0
        await repo.insert_commands(
            conn, campaign=row, expire_after_s=self.expire_after_s, node_id=self.node_id
        )
        await repo.insert_audit(
            conn,
            campaign_id=row.id,
            actor=actor,
            action="create",
            from_status=None,
            to_status=row.status,
            node_id=self.node_id,
            note=f"{len(devices)} commands",
            request_id=request_id,
        )
        created = await self._read(conn, row.id)
        await outbox.add_event(
            conn,
            aggregate_type=AGGREGATE,
            aggregate_id=str(row.id),
            event_type=events.EventType.CAMPAIGN_CREATED,
            payload=events.CampaignCreated(campaign=campaign_to_json(created), actor=actor),
        )
        return CampaignCreation(created, created=True), len(devices)

    async def _analyze(self, *, campaign_id: int, commands: int) -> None:
        """The campaign is committed: its commands' claims must not be planned from statistics
        that have not seen them (``analyze_commands`` in storage/queries/campaigns.sql says what
        that costs). A failure here costs speed only, so it is logged, not raised."""
        try:
            async with self.pool.acquire() as conn:
                await repo.analyze_commands(conn, lock_timeout_s=ANALYZE_LOCK_TIMEOUT_S)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning(
                "campaign_analyze_failed", campaign_id=campaign_id, commands=commands,
                error=repr(exc),
            )  # fmt: skip

    @staticmethod
    async def _read(
        conn: asyncpg.Connection | asyncpg.Pool, campaign_id: int
    ) -> CountedCampaignRow:
        row = await repo.get(conn, campaign_id)
        if row is None:
            raise CampaignNotFoundError(campaign_id)
        return row

    async def matching(self, selector: Sequence[str]) -> list[str]:
        """The devices a campaign with this selector would command if it started now: the
        known bound devices it picks, sorted (what ``create`` resolves it to)."""
        async with self.pool.acquire() as conn:
            try:
                return await _resolve(conn, Targets(selector=tuple(selector)), lock=False)
            except NoTargetsError:
                return []

    async def get(self, campaign_id: int) -> CountedCampaignRow:
        """The campaign with its count per command status, read in one statement."""
        return await self._read(self.pool, campaign_id)

    async def page(
        self, *, status: CampaignStatus | None, before_id: int | None, limit: int
    ) -> list[CampaignRow]:
        return await repo.list_campaigns(
            self.pool,
            status=None if status is None else status.value,
            before_id=before_id,
            limit=limit,
        )

    async def commands(
        self,
        campaign_id: int,
        *,
        status: CommandStatus | None,
        before_id: int | None,
        limit: int,
    ) -> list[CommandRow]:
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            await self._read(conn, campaign_id)
            return await repo.commands_of(
                conn,
                campaign_id,
                status=None if status is None else status.value,
                before_id=before_id,
                limit=limit,
            )

    async def cancel(
        self, campaign_id: int, *, actor: str, request_id: str | None = None
    ) -> CountedCampaignRow:
        """RUNNING → CANCELLED, and every command of it not yet terminal with it. Read, then
        a conditional write: closed when read is :class:`CampaignClosedError`, closed by the
        time of the write (someone else won) :class:`CampaignChangedError`."""
        async with self.pool.acquire() as conn, conn.transaction():
            await bound_lock_wait(conn)  # a person's change: rows a stopped node holds
            seen = await repo.status_of(conn, campaign_id)
            if seen is None:
                raise CampaignNotFoundError(campaign_id)
            if seen != CampaignStatus.RUNNING.value:
                raise CampaignClosedError(campaign_id, seen)
            done = await _closed(
                conn,
                campaign_id,
                status=CampaignStatus.CANCELLED,
                reason=f"cancelled by {actor}",
                actor=actor,
                action="cancel",
                node_id=self.node_id,
                request_id=request_id,
            )
            if done is None:
                current = await repo.changed_by(conn, campaign_id)
                if current is None:
                    raise CampaignNotFoundError(campaign_id)
                raise CampaignChangedError(campaign_id, *current)
        row, cancelled = done
        self._count(cancelled)
        return row

    def _count(self, cancelled: Sequence[MovedCommandRow]) -> None:
        if self.metrics is not None:
            for r in cancelled:
                self.metrics.count_command(r.previous_status, r.status)

    async def settle(self, campaign_id: int) -> CountedCampaignRow | None:
        """Close the campaign if its commands say so (COMPLETED or ABORTED); the closed row,
        or None when it keeps running or was closed already (by another node, say)."""
        async with self.pool.acquire() as conn, conn.transaction():
            # The lock first, the counts after: this statement waits for any other node
            # settling it, and the next one sees everything committed before that.
            locked = await repo.lock_running(conn, campaign_id)
            if locked is None:
                return None
            # Both or neither (the table's campaign_abort_pair).
            abort = (
                None
                if locked.failure_ratio is None or locked.min_finished is None
                else AbortCriteria(locked.failure_ratio, locked.min_finished)
            )
            verdict = settle(await repo.counts(conn, campaign_id), abort)
            if verdict is None:
                return None
            done = await _closed(
                conn,
                campaign_id,
                status=verdict.status,
                reason=verdict.reason,
                actor=SETTLER_ACTOR,
                action="abort" if verdict.status is CampaignStatus.ABORTED else "complete",
                node_id=self.node_id,
                request_id=None,
            )
        if done is None:  # unreachable under the lock; the write is conditional all the same
            return None
        row, cancelled = done
        self._count(cancelled)
        log.info(
            "campaign_closed",
            campaign_id=campaign_id,
            status=row.status,
            reason=verdict.reason,
            cancelled=len(cancelled),
        )
        return row

    async def settle_running(self) -> int:
        """One pass of the settler over every RUNNING campaign; how many it closed."""
        closed = 0
        for campaign in await repo.running(self.pool):
            # Without abort criteria only completion can close it, and an open command rules
            # that out: no lock and no count per status (a campaign's 10,000 commands) then.
            # Should its last command finish just after this read, that commit wakes the
            # settler again.
            if campaign.has_open and not campaign.may_abort:
                continue
            if await self.settle(campaign.id) is not None:
                closed += 1
        return closed


class CampaignSettler:
    """The loop on every node: woken when a campaign's command turns terminal, polling as a
    fallback (a node that died between a commit and its settling leaves nothing behind)."""

    def __init__(self, service: CampaignService, *, dsn: str, poll_s: float = 5.0) -> None:
        self.service = service
        self.dsn = dsn
        self.poll_s = poll_s

    async def run_once(self) -> int:
        return await self.service.settle_running()

    async def run(self, stop: asyncio.Event) -> None:
        await drain_on_notify(
            dsn=self.dsn,
            channel=NOTIFY_CHANNEL,
            stop=stop,
            step=self.run_once,
            poll_s=self.poll_s,
            name="campaign-settler",
        )
