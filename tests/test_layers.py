import pytest

from tasks.target.layers import AuxLayers, default_aux_layer_ids


@pytest.mark.parametrize("n, ids", [(8, (1, 3, 4)), (30, (1, 14, 26)), (32, (1, 15, 28)), (7, (1, 2, 3))])
def test_default_ids_follow_sglang(n, ids):
    assert default_aux_layer_ids(n) == ids


def test_hf_indices_are_one_past_layer_outputs():
    layers = AuxLayers.for_model(30)
    assert layers.hf_hidden_state_indices == (2, 15, 27)
    record = layers.as_record()
    assert record["sglang_layer_output_ids"] == [1, 14, 26]
    assert record["hf_hidden_states_indices"] == [2, 15, 27]
    assert record["final_state"] == "post-norm"
    assert "HF hidden_states[2, 15, 27]" in layers.describe()


@pytest.mark.parametrize("bad, why", [((1, 1, 4), r"\[1\] repeated"), ((4, 3, 1), "not ascending"),
                                      ((1, 2), "fewer than 3"), ((-1, 2, 3), "a negative id")])
def test_rejects_ids_that_are_not_three_distinct_ascending(bad, why):
    with pytest.raises(ValueError, match=rf"aux layer ids \[{', '.join(map(str, bad))}\]: {why}; give at least 3"):
        AuxLayers(bad)


def test_a_drafters_layers_are_found_in_a_stores_or_refused_naming_what_it_holds():
    store = AuxLayers((1, 2, 4, 5, 6))
    assert AuxLayers((2, 4, 5)).positions_in(store) == (1, 2, 3)
    assert store.positions_in(store) == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"aux layers \[3\] are not in the store, which holds outputs of layers "
                                         r"\[1, 2, 4, 5, 6\]"):
        AuxLayers((2, 3, 5)).positions_in(store)


def test_too_shallow_or_out_of_range():
    with pytest.raises(ValueError, match="6-layer"):
        default_aux_layer_ids(6)
    with pytest.raises(ValueError, match="out of range"):
        AuxLayers.for_model(8, (1, 3, 8))
    # The last layer's output: a real SGLang 0.5.23 server given it dies at
    # its first forward ("captured 2 aux hidden states, but ... names 3").
    with pytest.raises(ValueError, match=r"captures outputs of layers 0\.\.6"):
        AuxLayers.for_model(8, (1, 3, 7))
    assert AuxLayers.for_model(8, (1, 3, 6)).sglang_ids == (1, 3, 6)
