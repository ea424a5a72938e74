"""Which stages a request runs (``validate(stages=..., entry_stages=...)``), checked against the
stage graph before anything is queued: pure, on a diamond of echo stages (0 feeds 1 and 2, both
feed 3)."""

from __future__ import annotations

import pytest

from omni_runtime.engine.stage_graph import StageGraph
from omni_runtime.engine.validation import check_entry_stages, chosen_stages
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.resolve import resolve_config
from tests.conftest import echo_stage, make_config

pytestmark = pytest.mark.unit

INNER = {"final_output": False, "final_output_type": None}
DIAMOND = make_config(
    [
        echo_stage(0, **INNER),
        echo_stage(1, engine_input_source=[0], **INNER),
        echo_stage(2, engine_input_source=[0]),
        echo_stage(3, engine_input_source=[1, 2]),
    ]
)
GRAPH = StageGraph(resolve_config(DIAMOND))


def test_a_prompt_may_enter_past_the_sources_where_every_stage_that_runs_has_its_inputs() -> None:
    assert check_entry_stages(DIAMOND, GRAPH, [2], [2]) == [2]
    assert check_entry_stages(DIAMOND, GRAPH, [1, 2], [3]) == [1, 2]
    assert check_entry_stages(DIAMOND, GRAPH, [3], [3]) == [3]
    assert GRAPH.fed_by(0) == {1, 2, 3} and GRAPH.fed_by(3) == set()


@pytest.mark.parametrize(
    ("entries", "finals", "says"),
    [
        ([1], [3], "stage 3 also takes the output of stage 2"),  # 2 is fed by 0, which does not run
        ([2], [1], r"stage 1 \(a final stage of this request\) is not fed"),
        ([0, 2], [3], "stage 2 is fed by stage 0, also an entry"),
        ([], [3], "non-empty"),
        ([4], [3], "no stage 4"),
        ([1, 1], [3], "each stage id once"),
        (["1"], [3], "no stage '1'"),
    ],
)
def test_entries_that_would_leave_a_stage_waiting_forever_are_refused(entries, finals, says) -> None:
    with pytest.raises(InvalidRequestError, match=says) as err:
        check_entry_stages(DIAMOND, GRAPH, entries, finals)
    assert err.value.param in ("entry_stages", "stages")


def test_chosen_stages_are_distinct_ids_of_the_pipeline() -> None:
    assert chosen_stages(DIAMOND, (3, 1)) == [3, 1]
    for bad in (None, 3, "3", [None], [3.0], [-1], [True]):
        with pytest.raises(InvalidRequestError):
            chosen_stages(DIAMOND, bad)
