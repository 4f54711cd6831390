"""Groups packed into one row, a block each (``orchestrator.trainer.packing``): where each token
goes, what it may attend to, which logits the trained targets read, and when packing is chosen. That the
packed log-probs and gradients equal the unshared ones is ``test_trained_logits``'."""

from __future__ import annotations

import pytest
import torch

from orchestrator.trainer.packing import pack_by_group, packing_pays

# SmolLM2-135M: 2 x its 106 M decoder weights a token; 4 x 9 heads x 64 x 30 layers a pair.
TOKEN, PAIR = 2 * 106e6, 4 * 9 * 64 * 30.0
# Group 7: prefix [1, 2] then samples of 2 and 1 own tokens; group 3: prefix [5] then 2.
# (inputs, lengths, trained, group, prefix)
EXAMPLE = (torch.tensor([[1, 2, 10, 11], [1, 2, 20, 0], [5, 30, 31, 0]]), [4, 3, 3],
           torch.tensor([[False, True, True, True], [False, True, True, False],
                         [True, True, False, False]]), [7, 7, 3], [2, 2, 1])


def test_the_groups_follow_one_another_in_one_row_each_its_prefix_then_its_samples() -> None:
    packing = pack_by_group(*EXAMPLE)
    assert packing.input_ids.tolist() == [[1, 2, 10, 11, 20, 5, 30, 31]]  # no padding
    assert packing.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]  # each at its own position
    assert packing.bounds == ((0, 5), (5, 8))
    sees = packing.attention[0]
    assert sees[4].tolist() == [True, True, False, False, True]  # sample 2: prefix and itself
    assert sees[3].tolist() == [True, True, True, True, False]  # causal within sample 1
    assert sees[1].tolist() == [True, True, False, False, False]
    assert packing.attention[1].tolist() == torch.ones((3, 3), dtype=torch.bool).tril().tolist()
    # Logits: group 7 at 1 (the prefix's last, for both samples' first own token), 2, 3 and
    # 4; group 3 at 5 (its prefix, for token 30) and 6.
    assert packing.keep.tolist() == [[False, True, True, True, True, True, True, False]]


def test_the_groups_attend_stacked_one_to_a_row_under_an_additive_mask() -> None:
    blocks = pack_by_group(*EXAMPLE).blocks(torch.float32, "cpu", "sdpa")
    assert blocks.group.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] and blocks.inner == "sdpa"
    assert blocks.column.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert blocks.mask.shape == (2, 1, 5, 5)
    lowest = torch.finfo(torch.float32).min
    assert blocks.mask[0, 0, 4].tolist() == [0.0, 0.0, lowest, lowest, 0.0]
    assert blocks.mask[1, 0, 2].tolist() == [0.0, 0.0, 0.0, lowest, lowest]
    assert blocks.mask[1, 0, 3].tolist() == [lowest, lowest, lowest, 0.0, lowest]  # padding: itself


def test_trained_targets_read_the_logits_of_their_own_tokens() -> None:
    packing = pack_by_group(*EXAMPLE)
    inputs, _, trained, _, _ = EXAMPLE
    kept = packing.keep.flatten().nonzero().squeeze(1)  # packed positions of the kept logits
    flat_ids = packing.input_ids.flatten()
    # The token whose logits each trained target reads is the target's input token.
    read = flat_ids[kept[packing.rows]]
    assert read.tolist() == inputs[trained].tolist()
    assert packing.rows.tolist() == [0, 1, 2, 0, 3, 4, 5]


def test_a_trained_target_inside_the_shared_prefix_is_refused() -> None:
    inputs = torch.tensor([[1, 2, 3], [1, 2, 4]])
    trained = torch.tensor([[True, True, True], [False, True, True]])
    with pytest.raises(ValueError, match="inside its group's shared prefix"):
        pack_by_group(inputs, [3, 3], trained, [0, 0], [2, 2])


def test_packing_is_chosen_where_it_computes_less() -> None:
    group = [g for g in range(4) for _ in range(8)]
    # rg_smol: 43-token prompts, replies of 3 to 16 tokens: two passes pad every reply to 16.
    short = [43 + (3 if i % 3 else 16) for i in range(32)]
    assert packing_pays(short, group, [43] * 32, TOKEN, PAIR)
    # Replies of ~1,000 tokens: a packed row of 8,000 computes 64 M attention pairs a layer.
    long = [500 + 900 + (i % 8) * 20 for i in range(32)]
    assert not packing_pays(long, group, [500] * 32, TOKEN, PAIR)
    # Without attention's cost, fewer tokens always wins.
    assert packing_pays(long, group, [500] * 32, TOKEN, 0.0)
