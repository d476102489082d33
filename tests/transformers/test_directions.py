"""streamscope.directions on transformers: each method against plain torch/numpy on the oracle's values.

One tiny Llama for the module. The directions are found from prompts (the
harvest runs inside `find`) and held to the same computation done with
plain torch or numpy on transformers' float32 forward read with torch hooks
(tests/oracle.py): difference of means, the first principal component of the
paired differences, and a probe at its optimum (the gradient of its loss is
zero on the oracle's activations).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import direction_checks
from access import relative_error
from direction_checks import NEGATIVE, POSITIVE
import attention_oracle
import streamscope
from streamscope.bulk.results import Harvest
from streamscope.directions import Direction, export_gguf, find, import_gguf

RELATIVE = 1e-5


class Setup:
    def __init__(self, checkpoints):
        path = checkpoints("llama")
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.positive = direction_checks.oracle_last_positions(self.reference, "llama", self.tokenizer, POSITIVE)
        self.negative = direction_checks.oracle_last_positions(self.reference, "llama", self.tokenizer, NEGATIVE)


@pytest.fixture(scope="module")
def setup(checkpoints):
    return Setup(checkpoints)


def test_a_difference_of_means_per_block_equals_plain_torch_on_the_oracle(setup):
    sweep = find(setup.model, POSITIVE, NEGATIVE, method="mean_difference", progress=False)
    assert sweep.layers == list(range(setup.model.num_layers))
    for block in sweep.layers:
        expected = setup.positive[block].mean(0) - setup.negative[block].mean(0)
        direction = sweep[block]
        assert (direction.value, direction.layer, direction.method) == ("layer_output", block, "mean_difference")
        assert relative_error(direction.vector, expected) <= RELATIVE
        assert set(direction.scores) == {"accuracy", "separation", "steering"}
        assert 0 <= direction.scores["accuracy"] <= 1
    # best selects by steering (tests/transformers/test_direction_selection.py); by accuracy when asked.
    assert sweep.best_by("accuracy").scores["accuracy"] == max(score["accuracy"] for score in sweep.scores.values())


def test_pca_is_the_first_component_of_the_paired_differences(setup):
    sweep = find(setup.model, POSITIVE, NEGATIVE, method="pca", progress=False)
    for block in sweep.layers:
        component = torch.tensor(direction_checks.numpy_pca_component(setup.positive[block], setup.negative[block]))
        found = sweep[block].vector.double()
        cosine = float(found @ component / found.norm())
        assert abs(abs(cosine) - 1) <= 1e-6, (block, cosine)
        # Signed so the pairs' differences project positively on average.
        assert float((setup.positive[block] - setup.negative[block]).double().mean(0) @ found) > 0
        assert 0 < sweep[block].details["explained_variance"] <= 1


def test_a_probe_sits_at_its_optimum_on_the_oracle_values(setup):
    block = 1
    sweep = find(setup.model, POSITIVE, NEGATIVE, layers=[block], method="probe", progress=False)
    direction = sweep[block]
    features = torch.cat([setup.positive[block], setup.negative[block]]).double()
    labels = torch.cat([torch.ones(len(POSITIVE)), torch.zeros(len(NEGATIVE))]).double()
    # The probe's loss is over standardized features with an L2 penalty of 1e-3: its gradient there is zero.
    centre, spread = features.mean(0), features.std(0)
    weights = (direction.vector.double() * spread).requires_grad_(True)
    bias = torch.tensor(direction.bias + float((centre * direction.vector.double()).sum()), dtype=torch.float64,
                        requires_grad=True)
    standard = (features - centre) / spread
    loss = torch.nn.functional.binary_cross_entropy_with_logits(standard @ weights + bias, labels)
    (loss + 1e-3 * weights.pow(2).sum()).backward()
    assert float(weights.grad.abs().max()) <= 1e-5 and abs(float(bias.grad)) <= 1e-5
    # It separates the training examples of two clearly different prompt sets.
    predictions = (features @ direction.vector.double() + direction.bias) > 0
    assert float((predictions == labels.bool()).double().mean()) == 1.0


def test_a_probe_recovers_a_planted_direction_with_held_out_accuracy():
    generator = torch.Generator().manual_seed(0)
    planted = torch.randn(32, generator=generator)
    planted /= planted.norm()
    noise = torch.randn(400, 32, generator=generator)
    positive, negative = noise[:200] + 3 * planted, noise[200:] - 3 * planted
    vector, bias, scores, _ = streamscope.directions.fit(positive, negative, "probe", held_out=0.25)
    assert scores["accuracy"] == 1.0 and scores["separation"] > 3
    assert float(vector @ planted / vector.norm()) > 0.9
    # The same planted data with the labels shuffled: held-out accuracy near chance.
    mixed = torch.cat([positive, negative])[torch.randperm(400, generator=generator)]
    _, _, chance, _ = streamscope.directions.fit(mixed[:200], mixed[200:], "probe", held_out=0.25)
    assert chance["accuracy"] <= 0.7


def test_directions_from_a_harvest_equal_those_from_prompts(setup):
    model = setup.model
    positive = model.harvest(POSITIVE, "layer_output", positions="last", progress=False)
    negative = model.harvest(NEGATIVE, "layer_output", positions="last", progress=False)
    from_harvest = find(model, positive, negative, layers=[0, 2], progress=False)
    from_prompts = find(model, POSITIVE, NEGATIVE, layers=[0, 2], progress=False, steering=False)  # as harvests
    for block in (0, 2):
        assert torch.equal(from_harvest[block].vector, from_prompts[block].vector)
        assert from_harvest[block].scores == from_prompts[block].scores


def test_the_sweep_plot_and_table(setup, tmp_path):
    sweep = find(setup.model, POSITIVE, NEGATIVE, progress=False)
    path = sweep.plot(tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    table = sweep.table()
    assert table.count("block") == setup.model.num_layers + 1


def test_a_direction_saves_and_loads_and_refuses_a_model_of_another_shape(setup, tmp_path, checkpoints):
    direction = find(setup.model, POSITIVE, NEGATIVE, layers=[1], method="probe", progress=False)[1]
    written = direction.save(tmp_path / "love")
    assert written.suffix == ".safetensors"
    metadata = json.loads((tmp_path / "love.json").read_text())
    assert metadata["model"]["model_type"] == "llama" and metadata["layer"] == 1 and metadata["method"] == "probe"
    loaded = Direction.load(tmp_path / "love", setup.model)
    assert torch.equal(loaded.vector, direction.vector)
    assert (loaded.value, loaded.layer, loaded.method, loaded.bias, loaded.scores) == \
        (direction.value, direction.layer, direction.method, direction.bias, direction.scores)
    other = streamscope.load(checkpoints("gpt2"))
    with pytest.raises(ValueError, match="made on another model.*model_type 'llama' here, 'gpt2' on the model"):
        Direction.load(tmp_path / "love", other)
    # A steer made from it is refused on the other model too, before anything runs.
    steer = direction.steer(mode="ablate")
    steer.vector = steer.vector[:other.hidden_size] if other.hidden_size < setup.model.hidden_size else \
        torch.cat([steer.vector, torch.ones(other.hidden_size - setup.model.hidden_size)])
    with pytest.raises(ValueError, match="made on another model"):
        other.generate(POSITIVE[:1], max_tokens=1, steer=[steer], progress=False)


def test_steering_with_a_found_direction_moves_the_probe_score(setup):
    # Adding the difference of means at block 1 makes negative prompts look positive to block 2's probe;
    # ablating block 1's direction everywhere lowers the positives' projection on it.
    model = setup.model
    block = 1
    found = find(model, POSITIVE, NEGATIVE, layers=[block], progress=False)[block]
    steered = model.harvest(NEGATIVE, "layer_output", layers=[block], progress=False)  # baseline projection
    base = found.project(steered.stacked("layer_output")[:, 0, 0]).mean()
    result = model.generate(NEGATIVE, max_tokens=1, steer=[found.steer(scale=1.0, positions="last")],
                            harvest={"values": "layer_output", "layers": [block]}, progress=False)
    moved = found.project(result.harvest.stacked("layer_output")[:, 0, 0]).mean()
    expected_gap = float(found.vector.norm())  # adding v moves the projection on v/|v| by |v|
    assert abs(float(moved - base) - expected_gap) <= 1e-4 * expected_gap
    ablated = model.generate(POSITIVE, max_tokens=1, steer=[found.steer(mode="ablate", positions="last")],
                             harvest={"values": "layer_output", "layers": [block]}, progress=False)
    assert float(found.project(ablated.harvest.stacked("layer_output")[:, 0, 0]).abs().max()) <= 1e-5 * float(
        ablated.harvest.stacked("layer_output").abs().max())


def test_bad_input_is_refused_before_anything_runs(setup, monkeypatch):
    model = setup.model

    def no_harvest(*args, **kwargs):
        raise AssertionError("the harvest ran before the input was checked")

    with monkeypatch.context() as patched:
        patched.setattr(model, "harvest", no_harvest)
        with pytest.raises(ValueError, match="no negative examples.*examples of both"):
            find(model, POSITIVE, [], method="probe", progress=False)
        with pytest.raises(ValueError, match="pca takes pairs.*one negative per positive"):
            find(model, POSITIVE, NEGATIVE[:5], method="pca", progress=False)
        with pytest.raises(ValueError, match="unknown method 'lda'"):
            find(model, POSITIVE, NEGATIVE, method="lda", progress=False)
        with pytest.raises(ValueError, match="too few"):
            find(model, POSITIVE[:1], NEGATIVE[:1], progress=False)
        with pytest.raises(IndexError, match="out of range"):
            find(model, POSITIVE, NEGATIVE, layers=[99], progress=False)
    hidden, count = model.hidden_size, len(POSITIVE)
    narrow = Harvest({"layer_output": [torch.zeros(model.num_layers, 1, 3)] * count},
                     list(range(model.num_layers)), [[0]] * count)
    with pytest.raises(ValueError, match="3 wide.*the model %d" % hidden):
        find(model, narrow, narrow, progress=False)
    poisoned = Harvest({"layer_output": [torch.full((model.num_layers, 1, hidden), float("nan"))] * count},
                       list(range(model.num_layers)), [[0]] * count)
    with pytest.raises(ValueError, match="NaN or inf"):
        find(model, poisoned, poisoned, progress=False)


def test_gguf_control_vectors_export_and_import_in_repengs_layout(setup, tmp_path):
    model = setup.model
    sweep = find(model, POSITIVE, NEGATIVE, layers=[1, 2], progress=False)  # llama.cpp takes blocks 1 and up
    path = export_gguf(sweep, tmp_path / "love.gguf")
    # Read back with gguf's own reader: repeng's keys and tensor names.
    reader = gguf.GGUFReader(str(path))
    hint = reader.fields["controlvector.model_hint"]
    assert bytes(hint.parts[hint.data[0]]).decode() == "llama"
    count = reader.fields["controlvector.layer_count"]
    assert int(count.parts[count.data[0]][0]) == 2
    tensors = {tensor.name: np.array(tensor.data) for tensor in reader.tensors}
    assert sorted(tensors) == ["direction.1", "direction.2"]
    assert np.array_equal(tensors["direction.2"], sweep[2].vector.numpy())
    # A file written the way repeng writes one, read as directions to steer with.
    written = tmp_path / "repeng.gguf"
    writer = gguf.GGUFWriter(str(written), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", 2)
    vectors = {1: np.linspace(-1, 1, model.hidden_size, dtype=np.float32),
               2: np.cos(np.arange(model.hidden_size, dtype=np.float32))}
    for layer, vector in vectors.items():
        writer.add_tensor(f"direction.{layer}", vector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    imported = import_gguf(written, model)
    assert [(d.layer, d.value, d.method) for d in imported] == [(1, "layer_output", "gguf"), (2, "layer_output", "gguf")]
    for direction in imported:
        assert np.array_equal(direction.vector.numpy(), vectors[direction.layer])
    steers = streamscope.directions.steers(imported, scale=2.0)
    result = model.generate(POSITIVE[:1], max_tokens=1, steer=steers, return_logits=True, progress=False)
    plain = model.generate(POSITIVE[:1], max_tokens=1, steer=[streamscope.Steer("layer_output", layer,
                                                                                 torch.tensor(vector), scale=2.0)
                                                              for layer, vector in vectors.items()],
                           return_logits=True, progress=False)
    assert torch.equal(result.logits[0], plain.logits[0])
    narrow = tmp_path / "narrow.gguf"
    writer = gguf.GGUFWriter(str(narrow), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", 1)
    writer.add_tensor("direction.1", np.ones(model.hidden_size + 1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"direction.1 is {model.hidden_size + 1} wide.*made for another model"):
        import_gguf(narrow, model)
    other = streamscope.load(setup.model.config._name_or_path)
    other.config.model_type = "mistral"
    with pytest.raises(ValueError, match="made for a 'llama' model.*check_hint=False"):
        import_gguf(written, other)
