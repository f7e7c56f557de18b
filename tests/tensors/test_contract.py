"""Behaviours the API contract states for NestedTensor, each checked against torch on the elements or on `.tensor`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor


def seqs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, 4, generator=generator) for n in (3, 1, 2)]


def assert_elements(nt: NestedTensor, expected: list[torch.Tensor]) -> None:
    assert isinstance(nt, NestedTensor)
    assert len(nt) == len(expected)
    for actual, reference in zip(nt, expected):
        torch.testing.assert_close(actual, reference)


class TestConstructors:
    def test_flip_dims_keyword(self):
        elements = seqs()
        nt = NestedTensor(elements)
        assert_elements(nt.flip(dims=[1]), [e.flip([0]) for e in elements])
        assert_elements(torch.flip(nt, dims=(1, 2)), [e.flip([0, 1]) for e in elements])
        assert_elements(nt.flip(-1), [e.flip([-1]) for e in elements])

    def test_from_concatenated_device_dtype(self):
        nt = NestedTensor(seqs())
        out = NestedTensor.from_concatenated(*nt.concatenate(), dtype=torch.float64, device="cpu", padding_value=-1)
        assert out.dtype == torch.float64 and out.device.type == "cpu" and out.padding_value == -1
        assert_elements(out, [e.double() for e in seqs()])

    def test_from_tensor_mask_device_dtype(self):
        nt = NestedTensor(seqs())
        out = NestedTensor.from_tensor_mask(nt.tensor, nt.mask, dtype=torch.float16, device=torch.device("cpu"))
        assert out.dtype == torch.float16
        assert_elements(out, [e.half() for e in seqs()])

    def test_empty_honours_dtype_device(self):
        nt = NestedTensor([], dtype=torch.float64, device="cpu")
        assert nt.dtype == torch.float64 and nt.device.type == "cpu" and len(nt) == 0

    def test_non_prefix_mask_is_a_value_error(self):
        tensor = torch.arange(6).view(2, 3)
        with pytest.raises(ValueError, match="prefix"):
            NestedTensor.from_tensor_mask(tensor, torch.tensor([[1, 0, 1], [1, 1, 0]]))
        with pytest.raises(ValueError, match="prefix"):
            NestedTensor.from_tensor_mask(torch.arange(3), torch.tensor([0, 1, 1]))
        grid = torch.zeros(1, 2, 2)
        with pytest.raises(ValueError, match="prefix"):
            NestedTensor.from_tensor_mask(grid, torch.tensor([[[1, 0], [0, 1]]]))

    @pytest.mark.parametrize(
        "flags", [{"batch_first": 1}, {"batch_first": "yes"}, {"mask_value": None}, {"padding_value": "0"}]
    )
    def test_flag_types(self, flags):
        with pytest.raises(TypeError, match=next(iter(flags))):
            NestedTensor([[1, 2], [3]], **flags)
        with pytest.raises(TypeError, match=next(iter(flags))):
            NestedTensor.from_concatenated(torch.arange(3), [(2,), (1,)], **flags)
        nt = NestedTensor([[1, 2], [3]])
        with pytest.raises(TypeError, match=next(iter(flags))):
            setattr(nt, *next(iter(flags.items())))

    def test_to_torch_nested_scalars(self):
        nested = NestedTensor([1, 2, 3]).to_torch_nested()
        assert nested.is_nested
        assert [t.item() for t in nested.unbind()] == [1, 2, 3]


class TestTorchSemantics:
    def test_cat_with_dense(self):
        elements, dense = seqs(), torch.randn(2, 5, 4)
        nt = NestedTensor(elements)
        assert_elements(torch.cat([nt, dense]), [*elements, *dense.unbind(0)])
        dense3 = torch.randn(3, 2, 4)
        assert_elements(torch.cat([nt, dense3], dim=1), [torch.cat([e, d]) for e, d in zip(elements, dense3)])

    def test_dense_matmul_nested(self):
        elements = [torch.randn(4, n) for n in (3, 1)]
        weight = torch.randn(5, 4)
        assert_elements(weight @ NestedTensor(elements), [weight @ e for e in elements])
        assert_elements(torch.matmul(weight, NestedTensor(elements)), [weight @ e for e in elements])

    def test_linear_on_vectors(self):
        weight, bias = torch.randn(5, 4), torch.randn(5)
        elements = [torch.randn(4) for _ in range(3)]
        assert_elements(F.linear(NestedTensor(elements), weight, bias), [F.linear(e, weight, bias) for e in elements])
        ragged = [torch.randn(4), torch.randn(4)]
        assert_elements(F.linear(NestedTensor(ragged), weight), [F.linear(e, weight) for e in ragged])

    @pytest.mark.parametrize("name", ["sum", "mean", "amax", "amin", "prod"])
    def test_keepdim_without_dim(self, name):
        nt = NestedTensor(seqs())
        out = getattr(torch, name)(nt, keepdim=True) if name in {"amax", "amin"} else getattr(nt, name)(keepdim=True)
        expected = getattr(torch, name)(nt.concat)
        assert out.shape == (1, 1, 1)
        torch.testing.assert_close(out.reshape(()), expected)

    @pytest.mark.parametrize("batch_first", [True, False])
    def test_argmax_without_dim(self, batch_first):
        nt = NestedTensor([torch.tensor([-5.0, -4.0]), torch.tensor([-1.0, -9.0, -3.0])], batch_first=batch_first)
        nt.padding_value = 100.0  # padding must never win
        flat = torch.argmax(nt)
        assert nt.tensor.flatten()[flat] == -1.0
        assert nt.tensor.flatten()[torch.argmin(nt)] == -9.0

    def test_flatten_from_batch_dim(self):
        elements = [torch.randn(n, 2, 3) for n in (2, 4)]
        nt = NestedTensor(elements)
        torch.testing.assert_close(nt.flatten(start_dim=0), torch.cat([e.flatten() for e in elements]))
        torch.testing.assert_close(torch.flatten(nt, 0, 1), torch.cat(elements))
        assert_elements(nt.flatten(start_dim=1), [e.flatten() for e in elements])

    def test_masked_fill_broadcast_dense_mask(self):
        elements = seqs()
        nt = NestedTensor(elements)
        mask = torch.rand(nt.shape[:2]).unsqueeze(-1) > 0.5  # (B, L, 1) broadcasts to (B, L, D)
        expected = nt.tensor.masked_fill(mask, 7.0)
        out = nt.masked_fill(mask, 7.0)
        assert_elements(out, [row[: e.shape[0]] for row, e in zip(expected, elements)])
        feature = torch.tensor([True, False, False, True])  # (D,) broadcasts too
        assert_elements(nt.masked_fill(feature, 0.0), [e.masked_fill(feature, 0.0) for e in elements])

    def test_transpose_batch_toggles_batch_first(self):
        elements = seqs()
        nt = NestedTensor(elements)
        swapped = nt.transpose(0, 1)
        assert swapped.batch_first is False and swapped.shape == (3, 3, 4)
        torch.testing.assert_close(swapped.tensor, nt.tensor.transpose(0, 1))
        back = swapped.transpose(1, 0)
        assert back.batch_first is True
        assert_elements(back, elements)

    @pytest.mark.parametrize("batch_first", [True, False])
    def test_tensor_and_mask_indexing_match_padded(self, batch_first):
        elements = seqs()
        nt = NestedTensor(elements, batch_first=batch_first)
        mask = nt.mask
        torch.testing.assert_close(nt[mask], nt.tensor[mask])
        index = torch.tensor([2, 0]) if batch_first else torch.tensor([0, 2])
        out = nt[index]
        expected = nt.tensor[index]
        if batch_first:
            assert_elements(out, [elements[2], elements[0]])
        else:  # (L, B, D): the index picks sequence positions across the batch, padded where elements end
            assert isinstance(out, NestedTensor) and out.batch_first is False
            torch.testing.assert_close(out.tensor, expected)
            assert [tuple(e.shape) for e in out] == [(2, 4), (1, 4), (1, 4)]
            scattered = nt[torch.tensor([2, 0])]  # padding in the middle of elements: dense, as torch gives it
            torch.testing.assert_close(scattered, nt.tensor[torch.tensor([2, 0])])

    def test_row_mask_with_ragged_rows_is_nested(self):
        nt = NestedTensor(torch.arange(6.0).view(2, 3), torch.arange(2.0).view(2, 1))
        rows = torch.tensor([[True, False], [True, True]])  # a (B, L) mask over elements with ragged columns
        out = nt[rows]
        assert_elements(out, [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0]), torch.tensor([1.0])])

    @pytest.mark.parametrize("batch_first", [True, False])
    def test_boolean_mask_assignment(self, batch_first):
        elements = seqs()
        nt = NestedTensor(elements, batch_first=batch_first)
        mask = nt.mask & (nt.tensor[..., 0] > 0)
        expected = nt.tensor.clone()
        expected[mask] = 0.5
        nt[mask] = 0.5
        torch.testing.assert_close(nt.tensor, expected)
        values = torch.arange(float(mask.sum() * 4)).view(-1, 4)
        expected[mask] = values
        nt[mask] = values
        torch.testing.assert_close(nt.tensor, expected)

    def test_allclose_different_batches(self):
        a = NestedTensor(seqs())
        assert torch.allclose(a, a.clone())
        assert not torch.allclose(a, NestedTensor(seqs()[:2]))
        assert not torch.allclose(a, torch.zeros(5, 3, 4))

    def test_compare_with_other_types(self):
        nt = NestedTensor(seqs())
        assert (nt != "str") is True
        assert (nt == "str") is False
        assert (nt == nt).all()

    def test_attention_batch_second_and_dense_memory(self):
        generator = torch.Generator().manual_seed(0)
        queries = [torch.randn(2, n, 8, generator=generator) for n in (3, 5)]
        memory = torch.randn(2, 2, 6, 8, generator=generator)  # (B, heads, S, D), batch first like the query
        nt = NestedTensor(queries, batch_first=False)
        out = F.scaled_dot_product_attention(nt, memory.movedim(0, 1), memory.movedim(0, 1))
        expected = [F.scaled_dot_product_attention(q, m, m) for q, m in zip(queries, memory)]
        assert_elements(out, expected)
        shared = torch.randn(2, 6, 8, generator=generator)  # no batch dim: every element attends to it
        out = F.scaled_dot_product_attention(NestedTensor(queries), shared, shared)
        assert_elements(out, [F.scaled_dot_product_attention(q, shared, shared) for q in queries])

    def test_view_reshape_full_shape(self):
        elements = [torch.randn(n, 4) for n in (3, 1)]
        nt = NestedTensor(elements)
        assert_elements(nt.view(2, -1, 2, 2), [e.view(-1, 2, 2) for e in elements])
        assert_elements(nt.reshape(2, 3, 2, 2), [e.reshape(-1, 2, 2) for e in elements])
        assert_elements(nt.reshape(nt.shape), elements)
        assert_elements(nt.reshape(-1, 2), [e.reshape(-1, 2) for e in elements])  # an element shape

    @pytest.mark.parametrize("method", ["view", "reshape"])
    def test_view_reshape_take_the_element_shape_first(self, method):
        # The shape is that of each element, also when its first size equals the batch size.
        elements = [torch.arange(4.0), torch.arange(4.0, 8.0)]
        nt = NestedTensor(elements)
        assert_elements(getattr(nt, method)(2, 2), [e.view(2, 2) for e in elements])
        assert_elements(getattr(nt, method)((2, -1)), [e.view(2, 2) for e in elements])
        assert getattr(nt, method)(2, 2).shape == (2, 2, 2)
        ragged = [torch.arange(8.0), torch.arange(4.0)]  # (2, -1) fits each element: (2, 4) and (2, 2)
        assert_elements(getattr(NestedTensor(ragged), method)(2, -1), [e.view(2, -1) for e in ragged])
        single = NestedTensor([torch.arange(6.0).view(2, 3)])
        assert_elements(getattr(single, method)(1, 6), [torch.arange(6.0).view(1, 6)])
