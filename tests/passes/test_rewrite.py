"""``rewrite.reshape_views``: programs run op by op survive a layout the tracer did not
see."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from remat.passes.rewrite import reshape_views


def _flatten_program() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.view.default, (x, [8, 8])))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_view_a_layout_cannot_serve_runs_as_eagers_reshape():
    # traced on a contiguous (4, 2, 8) tensor, met at run time as a transpose
    x = torch.randn(4, 8, 2).transpose(1, 2)
    program = _flatten_program()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        program(x)
    reshape_views(program)
    torch.testing.assert_close(program(x), x.reshape(8, 8))


def test_where_the_layout_allows_a_view_it_stays_one():
    x = torch.randn(4, 2, 8)
    program = _flatten_program()
    reshape_views(program)
    out = program(x)
    assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
