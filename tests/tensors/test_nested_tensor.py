"""Behaviour of NestedTensor itself: construction, views, indexing, conversion, copying."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from danling.tensors import NestedTensor


def sample() -> NestedTensor:
    return NestedTensor(torch.tensor([1, 2, 3]), torch.tensor([4, 5]))


class TestConstruction:
    def test_forms_agree(self):
        a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
        for nt in (NestedTensor(a, b), NestedTensor([a, b]), NestedTensor((a, b)), NestedTensor([[1, 2, 3], [4, 5]])):
            assert nt.tolist() == [[1, 2, 3], [4, 5]]
            assert nt.dtype == torch.long
            assert isinstance(nt, torch.Tensor)

    def test_options(self):
        nt = NestedTensor([[1, 2, 3], [4, 5]], padding_value=-1, mask_value=True, dtype=torch.float)
        assert nt.dtype == torch.float32
        assert nt.tensor.tolist() == [[1, 2, 3], [4, 5, -1]]
        assert nt.mask.tolist() == [[False, False, False], [False, False, True]]
        assert nt.padding_value == -1 and nt.mask_value is True and nt.batch_first is True

    def test_requires_grad_makes_a_leaf(self):
        nt = NestedTensor([[1.0, 2.0], [3.0]], requires_grad=True)
        assert nt.requires_grad and nt._values.is_leaf
        nt.sum().backward()
        assert isinstance(nt.grad, NestedTensor)
        assert nt.grad.tolist() == [[1.0, 1.0], [1.0]]

    def test_bad_input(self):
        with pytest.raises(ValueError, match="iterable"):
            NestedTensor(5)
        with pytest.raises(ValueError, match="same number of dimensions"):
            NestedTensor(torch.zeros(2), torch.zeros(2, 2))
        with pytest.raises(TypeError, match="cannot be an element"):
            NestedTensor(sample(), torch.zeros(2))

    def test_scalar_elements(self):
        nt = NestedTensor([1, 2, 3])
        assert nt.shape == (3,) and nt.tensor.tolist() == [1, 2, 3] and nt.mask.tolist() == [True] * 3
        assert (nt * 2).tolist() == [2, 4, 6]

    def test_empty_batch(self):
        nt = NestedTensor([])
        assert len(nt) == 0 and nt.shape == (0,) and repr(nt) == "NestedTensor([])"


class TestViews:
    def test_multi_ragged_padding(self):
        a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0).view(4, 1)
        nt = NestedTensor(a, b, padding_value=-1)
        assert nt.shape == (2, 4, 3)
        expected = torch.full((2, 4, 3), -1.0)
        expected[0, :2, :3] = a
        expected[1, :4, :1] = b
        assert torch.equal(nt.tensor, expected)
        assert torch.equal(nt.mask, expected != -1)
        assert nt.concat.shape == (10,)

    def test_mask_drops_shared_trailing_dims(self):
        nt = NestedTensor(torch.zeros(3, 8), torch.zeros(1, 8))
        assert nt.mask.shape == (2, 3)
        assert nt.tensor_mask[0].shape == (2, 3, 8)

    def test_batch_second(self):
        nt = NestedTensor([torch.ones(3, 2), torch.ones(1, 2)], batch_first=False)
        assert nt.shape == (3, 2, 2)
        assert nt.tensor.shape == (3, 2, 2) and nt.mask.shape == (3, 2)
        assert nt.mask[:, 1].tolist() == [True, False, False]
        assert torch.equal(nt.nested_like(nt.tensor).concat, nt.concat)

    def test_occupancy_and_sizes(self):
        nt = sample()
        assert nt.occupancy == pytest.approx(5 / 6)
        assert nt.size() == (2, 3) and nt.size(-1) == 3 and nt.dim() == 2 and nt.numel() == 5 and len(nt) == 2

    def test_from_tensor_mask_roundtrip(self):
        nt = NestedTensor(torch.randn(3, 2), torch.randn(1, 2), torch.randn(4, 2))
        back = NestedTensor.from_tensor_mask(nt.tensor, nt.mask)
        assert back._shapes == nt._shapes and torch.equal(back.concat, nt.concat)
        grid = NestedTensor(torch.randn(2, 3), torch.randn(3, 1))
        back = NestedTensor.from_tensor_mask(grid.tensor, grid.tensor != 0)
        assert [tuple(e.shape) for e in back] == [(2, 3), (3, 1)]

    def test_from_tensor_mask_options(self):
        padded = torch.tensor([[1, 2, 0], [3, 0, 0]])
        inverted = NestedTensor.from_tensor_mask(padded, padded == 0, mask_value=True)
        assert inverted.tolist() == [[1, 2], [3]] and inverted.mask_value is True
        rows = NestedTensor.from_tensor_mask(padded, torch.tensor([False, True]), batched=True)
        assert rows.tolist() == [[3, 0, 0]]
        with pytest.raises(ValueError, match="does not match"):
            NestedTensor.from_tensor_mask(padded, torch.ones(3, 3))

    def test_from_concatenated_checks_shape(self):
        with pytest.raises(ValueError, match="does not hold"):
            NestedTensor.from_concatenated(torch.zeros(4), (torch.Size([3]), torch.Size([2])))

    def test_to_torch_nested(self):
        nt = NestedTensor(torch.randn(3, 4), torch.randn(2, 4))
        jagged = nt.to_torch_nested()
        assert jagged.is_nested
        for ours, theirs in zip(nt, jagged.unbind()):
            assert torch.equal(ours, theirs)

    def test_unbind_only_batch(self):
        with pytest.raises(ValueError, match="batch dim"):
            sample().unbind(1)
        assert [e.tolist() for e in sample().unbind()] == [[1, 2, 3], [4, 5]]


class TestIndexing:
    def test_get(self):
        nt = NestedTensor(torch.arange(6).view(3, 2), torch.arange(4).view(2, 2))
        assert torch.equal(nt[-1], torch.arange(4).view(2, 2))
        assert nt[[1, 0]].tolist() == [nt[1].tolist(), nt[0].tolist()]
        assert nt[torch.tensor([False, True])].tolist() == [nt[1].tolist()]
        assert nt[1:]._values.data_ptr() == nt._values[3:].data_ptr()  # contiguous slices share storage
        assert nt[:, :, 1].tolist() == [[1, 3, 5], [1, 3]]
        assert nt[..., 0].tolist() == [[0, 2, 4], [0, 2]]
        assert nt[0, 1].tolist() == [2, 3]
        assert nt[nt > 2].tolist() == [3, 4, 5, 3]
        with pytest.raises(IndexError, match="out of range"):
            nt[2]

    def test_a_list_of_booleans_selects_elements_as_a_boolean_tensor_does(self):
        # `nt.tensor[[False, True]]` selects the second row; `nt[[False, True]]` raised
        # "batch index must be an int, slice, list or tensor, got bool" although a list was given.
        nt = NestedTensor(torch.arange(6).view(3, 2), torch.arange(4).view(2, 2))
        assert nt[[False, True]].tolist() == nt[torch.tensor([False, True])].tolist() == [nt[1].tolist()]
        assert nt[[True, True], 0].tolist() == nt[torch.tensor([True, True]), 0].tolist()
        copied = nt.clone()
        copied[[True, False]] = NestedTensor(torch.zeros(3, 2, dtype=torch.long))
        assert copied[0].tolist() == [[0, 0]] * 3 and copied[1].tolist() == nt[1].tolist()
        with pytest.raises(IndexError, match=r"boolean batch selector must have shape \(2,\), got \(3,\)"):
            nt[[True, False, True]]

    def test_a_value_of_fewer_dims_fills_whole_elements_as_torch_broadcasts_it(self):
        # `t[0] = 0` fills a tensor's row; `nt[0] = 0` replaced the element by a 0-d tensor and
        # failed: "all elements of a NestedTensor must have the same number of dimensions".
        nt = NestedTensor(torch.arange(6).view(3, 2), torch.arange(4).view(2, 2))
        storage = nt._values.data_ptr()
        nt[0] = 0
        assert nt.tolist() == [[[0, 0]] * 3, [[0, 1], [2, 3]]]
        nt[:] = torch.tensor([5, 6])  # a row for every element
        assert nt.tolist() == [[[5, 6]] * 3, [[5, 6]] * 2]
        nt[[False, True]] = -1
        assert nt.tolist() == [[[5, 6]] * 3, [[-1, -1]] * 2]
        assert nt._values.data_ptr() == storage  # shapes kept: written in place
        with pytest.raises(RuntimeError):
            nt[1] = torch.tensor([1, 2, 3])  # as torch refuses a row of the wrong size
        nt[1] = torch.tensor([[1, 2, 3]])  # as many dims: the element is replaced, as documented
        assert nt[1].tolist() == [[1, 2, 3]]

    def test_set(self):
        nt = sample()
        nt[:, 0] = 0
        assert nt.tolist() == [[0, 2, 3], [0, 5]]
        nt[nt > 2] = -1
        assert nt.tolist() == [[0, 2, -1], [0, -1]]
        nt[:] = NestedTensor([[7], [8, 9]])
        assert nt.tolist() == [[7], [8, 9]] and nt.shape == (2, 2)
        nt[1] = [1.5, 2.5, 3.5]  # converted to the NestedTensor's dtype
        assert nt.tolist() == [[7], [1, 2, 3]]


class TestConversion:
    def test_to_and_dtype(self):
        nt = sample()
        assert nt.to(nt.device) is nt
        assert nt.to(torch.float64).dtype == torch.float64
        assert nt.to(torch.zeros(1, dtype=torch.float16)).dtype == torch.float16
        assert nt.to(NestedTensor([[1.0]])).dtype == torch.float32
        assert nt.float().dtype == torch.float32 and nt.bool().dtype == torch.bool
        nt.dtype = torch.float64
        assert nt.concat.dtype == torch.float64

    def test_pin_memory_delegates_to_values(self):
        nt = sample()
        try:
            expected = nt.concat.pin_memory()
        except RuntimeError:
            with pytest.raises(RuntimeError):
                nt.pin_memory()
            return
        pinned = nt.pin_memory()
        assert pinned.concat.is_pinned() and torch.equal(pinned.concat, expected)

    def test_copy_and_pickle(self):
        nt = NestedTensor([[1.0, 2.0], [3.0]], padding_value=9.0, batch_first=False)
        shallow = copy.copy(nt)
        deep = copy.deepcopy(nt)
        assert shallow.concat.data_ptr() == nt.concat.data_ptr()
        assert deep.concat.data_ptr() != nt.concat.data_ptr()
        loaded = pickle.loads(pickle.dumps(nt))
        for other in (shallow, deep, loaded):
            assert other.tolist() == nt.tolist()
            assert other.padding_value == 9.0 and other.batch_first is False

    @pytest.mark.parametrize(
        ("index", "value"),
        [
            (0, [-1.0, -1.0, -1.0]),
            (-1, [-1.0, -1.0]),
            ((0, 1), -1.0),
            ((1, slice(0, 1)), -1.0),
            ((slice(None), 0), -1.0),
        ],
        ids=["element", "last", "tuple", "slice", "column"],
    )
    def test_shallow_copy_shares_writes_both_ways(self, index, value):
        # As for a tensor: an assignment through either copy that keeps the element shapes is
        # seen through the other.
        nt = NestedTensor([[1.0, 2.0, 3.0], [4.0, 5.0]])
        shallow = copy.copy(nt)
        shallow[index] = value
        assert nt.tolist() == shallow.tolist() != [[1.0, 2.0, 3.0], [4.0, 5.0]]
        nt[index] = torch.tensor(value) * 2
        assert shallow.tolist() == nt.tolist()
        nt[nt.mask] = 7.0  # a boolean index into the padded view
        assert shallow.tolist() == nt.tolist() == [[7.0, 7.0, 7.0], [7.0, 7.0]]
        shallow[0] = torch.tensor([1.0])  # another element shape: the storage is replaced
        assert nt.tolist() == [[7.0, 7.0, 7.0], [7.0, 7.0]] and shallow.tolist() == [[1.0], [7.0, 7.0]]

    def test_assignment_in_place_follows_autograd_as_a_tensor(self):
        weight = torch.ones(2, requires_grad=True)
        nt = NestedTensor([[1.0, 2.0], [3.0]])
        nt[0] = weight * 2  # recorded: the gradient reaches `weight`
        nt.sum().backward()
        assert weight.grad.tolist() == [2.0, 2.0]
        leaf = NestedTensor([[1.0, 2.0], [3.0]], requires_grad=True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            leaf[0] = torch.zeros(2)
        with torch.no_grad():
            leaf[0] = torch.zeros(2)
        assert leaf.tolist() == [[0.0, 0.0], [3.0]] and leaf.requires_grad

    def test_torch_save_roundtrip(self, tmp_path):
        nt = NestedTensor(torch.randn(3, 2), torch.randn(1, 2))
        torch.save({"x": nt}, tmp_path / "nt.pt")
        loaded = torch.load(tmp_path / "nt.pt", weights_only=False)["x"]
        assert torch.equal(loaded.tensor, nt.tensor)

    def test_equality_and_truthiness(self):
        a, b = sample(), sample()
        assert isinstance(a == b, NestedTensor) and bool((a == b).all())
        assert not bool((a != b).any())
        assert torch.equal(a, b) and not torch.equal(a, NestedTensor([[1, 2, 3], [4]]))
        assert torch.allclose(a.float(), b.float())
        with pytest.raises(RuntimeError, match="ambiguous"):
            bool(a)
        assert bool(NestedTensor([[1]]))

    def test_repr_and_format(self):
        assert repr(NestedTensor([[1.5], [2.0, 3.0]])) == "NestedTensor([\n    [1.5000],\n    [2., 3.]\n])"
        assert f"{NestedTensor([[2.0]]):.1f}" == "2.0"

    def test_metadata_attributes(self):
        nt = NestedTensor(torch.zeros(2, 3), torch.zeros(1, 3))
        assert not nt.is_cuda and nt.layout == torch.strided and nt.is_floating_point()
        assert nt.ndim == 3 and nt.T.shape == (2, 3, 2) and nt.mT.shape == (2, 3, 2)
        assert isinstance(nt.new_zeros(2), torch.Tensor) and not isinstance(nt.new_zeros(2), NestedTensor)
        assert nt.is_nested is False
        assert isinstance(nt.data, NestedTensor)


class TestReductionsAndWhere:
    def test_max_min_indices(self):
        nt = NestedTensor([[1, 5, 2], [7, 3]])
        result = nt.max(dim=1)
        assert result.values.tolist() == [5, 7] and result.indices.tolist() == [1, 0]
        assert nt.max().item() == 7 and nt.min().item() == 1
        assert torch.max(nt, NestedTensor([[2, 2, 2], [2, 2]])).tolist() == [[2, 5, 2], [7, 3]]

    def test_padding_never_counts(self):
        nt = NestedTensor([[-1.0, -2.0], [-3.0]], padding_value=100.0)
        assert nt.max(dim=1).values.tolist() == [-1.0, -3.0]
        assert nt.mean(dim=1).tolist() == [-1.5, -3.0]
        assert NestedTensor([[True, True], [True]]).all(dim=1).tolist() == [True, True]
        assert NestedTensor([[0, 2], [3]]).prod(dim=1).tolist() == [0, 3]

    def test_invalid_reductions(self):
        nt = NestedTensor(torch.zeros(2, 3, 4), torch.zeros(3, 2, 4))
        with pytest.raises(ValueError, match="ragged"):
            nt.sum(dim=(0, 1))
        with pytest.raises(RuntimeError, match="floating point"):
            NestedTensor([[1, 2], [3]]).mean(dim=1)
        assert torch.count_nonzero(NestedTensor([[0, 1], [2]])).item() == 2

    def test_where_forms(self):
        nt = sample()
        assert torch.where(nt > 2, nt, 0).tolist() == [[0, 0, 3], [4, 5]]
        assert nt.where(nt > 3, torch.tensor(-1)).tolist() == [[-1, -1, -1], [4, 5]]

    def test_cat(self):
        a, b = sample(), NestedTensor([[6]])
        assert torch.cat([a, b]).tolist() == [[1, 2, 3], [4, 5], [6]]
        assert torch.cat([a, a], dim=1).tolist() == [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5]]


class TestSequenceModel:
    def test_training_reduces_loss(self):
        torch.manual_seed(0)
        sequences = NestedTensor([torch.randint(0, 11, (n,)) for n in (5, 2, 7, 3)])
        labels = torch.tensor([0, 1, 0, 1])
        embed, head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 2)
        optimizer = torch.optim.Adam([*embed.parameters(), *head.parameters()], lr=0.05)
        losses = []
        for _ in range(30):
            hidden = torch.nn.functional.gelu(embed(sequences))
            attention = hidden.sum(dim=-1, keepdim=True).softmax(dim=1)
            pooled = (hidden * attention).sum(dim=1)
            loss = torch.nn.functional.cross_entropy(head(pooled), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.5


class TestIntegration:
    def test_to_device_moves_nested_batches(self):
        from danling.utils import to_device

        batch = {"input": NestedTensor([[1.0, 2.0], [3.0]]), "label": torch.tensor([0, 1])}
        moved = to_device(batch, "cpu", non_blocking=True)
        assert isinstance(moved["input"], NestedTensor)
        assert moved["input"].tolist() == [[1.0, 2.0], [3.0]]

    def test_dropout_in_training_mode(self):
        torch.manual_seed(0)
        nt = NestedTensor(torch.ones(50, 4), torch.ones(30, 4))
        dropped = torch.nn.functional.dropout(nt, 0.5, training=True)
        assert isinstance(dropped, NestedTensor) and dropped._shapes == nt._shapes
        assert set(dropped.concat.unique().tolist()) == {0.0, 2.0}

    def test_attention_with_extra_mask(self):
        torch.manual_seed(0)
        elements = [torch.randn(2, n, 4) for n in (3, 5)]
        nt = NestedTensor(elements)
        window = torch.ones(5, 5, dtype=torch.bool).triu(-1)  # dense mask over padded positions
        out = torch.nn.functional.scaled_dot_product_attention(nt, nt, nt, attn_mask=window)
        for got, e in zip(out, elements):
            n = e.shape[1]
            want = torch.nn.functional.scaled_dot_product_attention(e, e, e, attn_mask=window[:n, :n])
            torch.testing.assert_close(got, want)
        additive = torch.zeros(5, 5).masked_fill(~window, float("-inf"))
        out_additive = torch.nn.functional.scaled_dot_product_attention(nt, nt, nt, attn_mask=additive)
        torch.testing.assert_close(out_additive.concat, out.concat)

    def test_backward_from_a_nested_output(self):
        leaf = torch.randn(3, 2, requires_grad=True)
        out = NestedTensor(leaf, torch.randn(1, 2)) * 3
        out.backward(NestedTensor(torch.ones(3, 2), torch.ones(1, 2)))
        torch.testing.assert_close(leaf.grad, torch.full((3, 2), 3.0))
