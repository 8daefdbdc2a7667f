"""What the engine learns while it serves, besides answers, kept per tenant: the target's
recycled predictions and the acceptance statistics per draft source.

Both are observable through a stream's drafted and accepted counts, as the suffix index is
(server.engine.tenant_index): recycled predictions are the target's top next tokens after each
token, as the last pass that read that token computed them, so a caller whose prompt repeats
another caller's answer would find it drafted; shared acceptance rates would tell a caller how
well other callers' requests matched the context and the index. So (with scope `tenant`, the
default) each tenant has its own table and its own rates, and a new tenant starts from an
empty table and the uninformed priors, exactly as on a fresh server. With scope `shared`
every request is SHARED_TENANT's: one table, one set of rates.

At most `max_tenants` tenants are held (--suffix-index-tenants, the suffix index's bound), the
least recently used dropped whole. A recycled table is vocabulary x 8 x 8 bytes plus two Python
lists of the vocabulary's length (about 3.9 MB for the default model), and made at a tenant's
first request. A generation keeps the state it started with: a tenant dropped while its request
runs learns into a table nobody reads afterwards.

Thread safety: `of` runs where requests start (the event loop, in the server), `forget` at
load before serving; nothing else touches the table of tenants. Each generation keeps
references to its tenant's table and rates, which the engine thread then uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculator import AcceptanceStats


@dataclass(frozen=True, slots=True)
class TenantState:
    """One tenant's learned drafting state."""

    recycled: RecycledPredictions | None  # None: recycled predictions are off
    acceptance: AcceptanceStats


class TenantStates:
    """Each tenant's TenantState, at most `max_tenants` of them (see the module doc)."""

    def __init__(
        self, new_recycled: Callable[[], RecycledPredictions] | None, max_tenants: int
    ) -> None:
        if max_tenants < 1:
            raise ValueError(f"need max_tenants >= 1, got {max_tenants}")
        self._new_recycled = new_recycled
        self.max_tenants = max_tenants
        self._states: OrderedDict[str, TenantState] = OrderedDict()  # least recent first

    def of(self, tenant: str) -> TenantState:
        """`tenant`'s state, made fresh at its first request (or after it was dropped)."""
        state = self._states.get(tenant)
        if state is None:
            recycled = self._new_recycled() if self._new_recycled is not None else None
            state = TenantState(recycled, AcceptanceStats())
            self._states[tenant] = state
            while len(self._states) > self.max_tenants:
                self._states.popitem(last=False)
        self._states.move_to_end(tenant)
        return state

    def adopt(self, tenant: str, state: TenantState) -> None:
        """Hold `state` as `tenant`'s (the shared tenant's table the engine was given)."""
        self._states[tenant] = state
        self._states.move_to_end(tenant)
        while len(self._states) > self.max_tenants:
            self._states.popitem(last=False)

    def forget(self, tenant: str) -> None:
        """Drop `tenant`'s state (the warm-up's, say)."""
        self._states.pop(tenant, None)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._states
