"""LoRA adapters in the scheduler: the running requests' adapters never outnumber the workers'
slots, requests of other adapters (or none) go past one that must wait for a slot, the slot table
keeps loaded adapters and evicts the least recently used one no running request needs, and the
block hashes of equal prompts under different adapters differ."""

from __future__ import annotations

from engine.lora.request import LoRARequest, prefix_cache_salt
from engine.sched.block_pool import chain_block_hashes
from engine.sched.lora_slots import LoRASlotTable
from tests.unit.scheduler_helpers import make_request, run_until_done, scheduler_and_worker, step

SQL, CHAT, CODE = (
    LoRARequest(name, index + 1, f"/adapters/{name}") for index, name in enumerate(["sql", "chat", "code"])
)


def test_slot_table_keeps_loaded_adapters_and_evicts_the_least_recently_used() -> None:
    table = LoRASlotTable(max_loras=2)
    assert table.assign([SQL, None, SQL]) == {0: SQL}
    assert table.assign([CHAT, SQL]) == {1: CHAT}
    assert table.assign([SQL, CHAT]) == {}  # both loaded: nothing to do
    assert table.assign([CODE, CHAT]) == {0: CODE}  # SQL, which no running request uses, goes
    assert (table.num_loads, table.num_evictions) == (3, 1)
    stats = table.stats([CODE, CODE, None], [SQL])
    assert stats.running == {"code": 2} and stats.waiting == {"sql": 1}


def test_fits_counts_distinct_adapters() -> None:
    assert LoRASlotTable.fits([SQL, SQL, None], CHAT, max_loras=2)
    assert not LoRASlotTable.fits([SQL, CHAT], CODE, max_loras=2)
    assert LoRASlotTable.fits([SQL, CHAT], SQL, max_loras=2)
    assert LoRASlotTable.fits([SQL, CHAT], None, max_loras=2)


def test_running_adapters_never_outnumber_the_slots() -> None:
    """One slot: the first adapter's requests and the base model's run, the other adapter's wait
    (without holding up those behind them) and run once the slot is free; every request finishes."""
    scheduler, worker = scheduler_and_worker(num_blocks=64, max_loras=1)
    requests = [
        make_request("a", range(1, 6), max_tokens=4, lora_request=SQL),
        make_request("b", range(1, 6), max_tokens=4, lora_request=CHAT),
        make_request("c", range(1, 6), max_tokens=4, lora_request=SQL),
        make_request("d", range(1, 6), max_tokens=4),
    ]
    for request in requests:
        scheduler.add_request(request)
    out, _ = step(scheduler, worker)
    assert set(out.num_scheduled_tokens) == {"a", "c", "d"}
    assert out.lora_loads == {0: SQL}
    seen_loads = [out.lora_loads]
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, worker)
        adapters = {request.lora_request for request in scheduler.running if request.lora_request}
        assert len(adapters) <= 1
        if out.lora_loads:
            seen_loads.append(out.lora_loads)
    assert seen_loads == [{0: SQL}, {0: CHAT}]
    assert scheduler.make_stats().lora.num_evictions == 1


def test_equal_prompts_under_different_adapters_hash_apart() -> None:
    tokens = list(range(32))
    plain = chain_block_hashes(tokens, 16)
    sql = chain_block_hashes(tokens, 16, cache_salt=prefix_cache_salt(None, SQL))
    chat = chain_block_hashes(tokens, 16, cache_salt=prefix_cache_salt(None, CHAT))
    salted_sql = chain_block_hashes(tokens, 16, cache_salt=prefix_cache_salt("tenant", SQL))
    assert len({plain[0], sql[0], chat[0], salted_sql[0]}) == 4
    assert sql == chain_block_hashes(tokens, 16, cache_salt=prefix_cache_salt(None, SQL))


def test_lora_requests_run_to_completion_with_prefix_caching() -> None:
    scheduler, worker = scheduler_and_worker(num_blocks=32, max_loras=2)
    for index, lora in enumerate([SQL, CHAT, CODE, None, SQL]):
        scheduler.add_request(make_request(f"r{index}", range(1, 20), max_tokens=3, lora_request=lora))
    tokens, _ = run_until_done(scheduler, worker)
    assert all(len(output) == 3 for output in tokens.values()) and len(tokens) == 5


def test_a_removed_adapter_loads_afresh() -> None:
    table = LoRASlotTable(max_loras=2)
    table.assign([SQL])
    table.forget(SQL.lora_int_id)
    replaced = LoRARequest("sql", SQL.lora_int_id, "/adapters/sql-v2")
    assert table.assign([replaced]) == {0: replaced}
