"""Queue-aware KV pressure: the first waiting request's unmet demand counts as pressure (hand-computed cases)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedweight.serving.serving_loop import CLIP_MAX_NEW_TOKENS, PagedWeightScheduler, head_of_line_demand_tokens


def _req(prompt: int, max_new: int):
    return SimpleNamespace(origin_input_ids=list(range(prompt)), sampling_params=SimpleNamespace(max_new_tokens=max_new))


def _sched(queue, ratio=0.7, max_total=1000):
    return SimpleNamespace(waiting_queue=queue, new_token_ratio_tracker=SimpleNamespace(current=ratio),
                           max_total_num_tokens=max_total)


def test_head_of_line_demand_is_prompt_plus_expected_output():
    assert head_of_line_demand_tokens(_sched([_req(100, 50), _req(9999, 9999)])) == 100 + 35  # ceil(50 * 0.7)
    assert head_of_line_demand_tokens(_sched([])) == 0
    big = head_of_line_demand_tokens(_sched([_req(10, 100_000)], ratio=1.0))
    assert big == 10 + CLIP_MAX_NEW_TOKENS  # SGLang's clip of the output estimate


def _pws(page=4, max_tokens=1000, queue_aware=True, capacity_tokens=400):
    kv = SimpleNamespace(max_tokens=max_tokens, capacity_tokens=capacity_tokens)
    return PagedWeightScheduler(runtime=None, controller=SimpleNamespace(kv=kv), page_size=page, capacity_blocks=100,
                                queue_aware=queue_aware)


def test_waiting_blocks_counts_only_what_is_missing():
    pws = _pws(page=4)
    s = _sched([_req(200, 40)], ratio=0.5)  # 200 + 20 = 220 tokens = 55 blocks
    assert pws._waiting_blocks(s, free_blocks=60) == 0  # it fits
    assert pws._waiting_blocks(s, free_blocks=50) == 5
    assert pws._waiting_blocks(_sched([]), free_blocks=0) == 0


def test_a_request_no_plan_can_fit_is_not_pressure():
    pws = _pws(page=1, max_tokens=500)
    assert pws._waiting_blocks(_sched([_req(600, 0)]), free_blocks=10) == 0


def test_a_lack_the_weights_cannot_cover_now_is_not_pressure():
    """Capacity 400 of at most 500 tokens: the weights can give 100 more. A request lacking 90 counts; one
    lacking 150 must wait for running requests to finish, so it does not push bitwidths down."""
    pws = _pws(page=1, max_tokens=500, capacity_tokens=400)
    assert pws._waiting_blocks(_sched([_req(300, 0)]), free_blocks=210) == 90
    assert pws._waiting_blocks(_sched([_req(300, 0)]), free_blocks=150) == 0
    pws.controller.kv.capacity_tokens = 350  # after shrinking: 150 can be given back again
    assert pws._waiting_blocks(_sched([_req(300, 0)]), free_blocks=150) == 150


def test_without_an_elastic_cache_waiting_is_never_pressure():
    pws = PagedWeightScheduler(runtime=None, controller=SimpleNamespace(kv=None), page_size=1, capacity_blocks=100)
    assert pws._waiting_blocks(_sched([_req(300, 0)]), free_blocks=250) == 0


def test_queue_awareness_can_be_switched_off():
    assert _pws(queue_aware=False)._waiting_blocks(_sched([_req(200, 40)]), free_blocks=0) == 0
