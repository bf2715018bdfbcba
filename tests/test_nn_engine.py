"""The shared module-replacement engine: install, record, report, undo — with small test layers only."""

import copy
import functools
import gc
import pickle
import types
import weakref

import pytest
import torch
from torch import nn

from tritonspec.nn import engine


class Scale(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        return x * self.s


def _double(self, x):
    return x * self.s * 2


def _triple(self, x):
    return x * self.s * 3


def _model():
    return nn.Sequential(Scale(1.0), nn.Sequential(Scale(2.0), Scale(3.0)))


def test_replace_forward_and_revert_restore_class_forward():
    m = _model()
    x = torch.randn(4)
    ref = m(x)
    ch = engine.replace_forward(m, m[0], _double, path="0", kernel="k", source="test")
    assert "forward" in vars(m[0]) and ch.path == "0" and ch.what == "forward"
    torch.testing.assert_close(m(x), ref * 2)
    undone = engine.revert(m)
    assert [c.path for c in undone] == ["0"]
    assert "forward" not in vars(m[0])  # the class method shows through again
    torch.testing.assert_close(m(x), ref)
    assert engine.report(m) == []


def test_second_patch_keeps_first_original_and_updates_report():
    m = _model()
    x = torch.randn(3)
    ref = m(x)
    engine.replace_forward(m, m[0], _double, path="0", kernel="double", source="a")
    engine.replace_forward(m, m[0], _triple, path="0", kernel="triple", source="b")
    rep = engine.report(m)
    assert len(rep) == 1 and rep[0].kernel == "triple" and rep[0].source == "b"
    torch.testing.assert_close(m(x), ref * 3)
    engine.revert(m)
    torch.testing.assert_close(m(x), ref)


def test_instance_forward_set_before_patching_comes_back():
    m = _model()
    custom = types.MethodType(_triple, m[0])
    m[0].forward = custom
    engine.replace_forward(m, m[0], _double, path="0", kernel="k", source="t")
    engine.revert(m)
    assert m[0].forward is custom


def test_shared_patch_restored_only_after_last_owner_reverts():
    holder = types.SimpleNamespace(fn=lambda: "orig")
    orig = holder.fn
    a, b = _model(), _model()
    engine.patch_attr(a, holder, "fn", lambda: "new", path="holder.fn", kernel="k", source="t", shared=True)
    engine.patch_attr(b, holder, "fn", lambda: "new2", path="holder.fn", kernel="k", source="t", shared=True)
    assert engine.shared_original(holder, "fn") is orig
    engine.revert(a)
    assert holder.fn() == "new2"  # b still holds it
    engine.revert(b)
    assert holder.fn is orig
    assert engine.shared_original(holder, "fn", "unpatched") == "unpatched"


def test_replace_module_resolves_live_path_and_reverts():
    m = _model()
    x = torch.randn(5)
    ref = m(x)
    old = m[1][0]
    engine.replace_module(m, "1.0", Scale(20.0), kernel="Scale", source="t")
    torch.testing.assert_close(m(x), ref * 10)
    engine.revert(m)
    assert m[1][0] is old
    torch.testing.assert_close(m(x), ref)


def test_replace_root_is_refused():
    with pytest.raises(ValueError, match="root"):
        engine.replace_module(_model(), "", Scale(1.0), kernel="k", source="t")


def test_transaction_rolls_back_on_error_and_reports_made_changes():
    m = _model()
    engine.replace_forward(m, m[0], _double, path="0", kernel="k", source="t")
    with pytest.raises(RuntimeError, match="boom"):
        with engine.transaction(m):
            engine.replace_forward(m, m[1][0], _double, path="1.0", kernel="k", source="t")
            raise RuntimeError("boom")
    assert engine.report(m).paths() == ["0"]
    assert "forward" not in vars(m[1][0])
    with engine.transaction(m) as made:
        engine.replace_forward(m, m[1][1], _double, path="1.1", kernel="k", source="t")
    assert made.paths() == ["1.1"]
    engine.revert(m)


def test_restore_single_change():
    m = _model()
    engine.replace_forward(m, m[0], _double, path="0", kernel="k", source="t")
    engine.replace_forward(m, m[1][0], _double, path="1.0", kernel="k", source="t")
    assert engine.restore(m, m[0]) is True
    assert engine.restore(m, m[0]) is False
    assert engine.report(m).paths() == ["1.0"]
    engine.revert(m)


def test_record_custom_runs_undo_once():
    m = _model()
    calls = []
    engine.record_custom(m, m, "thing", lambda: calls.append(1), path="", what="attribute", kernel="k", source="t")
    engine.record_custom(m, m, "thing", lambda: calls.append(2), path="", what="attribute", kernel="k2", source="t")
    assert engine.report(m)[0].kernel == "k2"
    engine.revert(m)
    assert calls == [1]


def test_a_switch_reports_what_it_selects_now():
    """A transformers switch (``what`` in engine.SWITCHES) is the user's to turn again: report() reads it, a deep
    copy's report its own; revert runs the undo whatever it selects now."""
    m = _model()
    m.config = types.SimpleNamespace(_experts_implementation="ours")
    undo = functools.partial(setattr, m.config, "_experts_implementation", "before")
    engine.record_custom(
        m, m.config, "_experts_implementation", undo, path="", what="experts_implementation", kernel="k", source="t"
    )
    ours = engine.report(m)
    assert ours.counts() == {"k": 1}
    m.config._experts_implementation = "eager"
    (now,) = engine.report(m)
    assert (now.kernel, now.what, now.source) == ("eager", "experts_implementation", "t")
    assert "switched to 'eager' since t set 'ours'" in now.detail
    twin = copy.deepcopy(m)
    twin.config._experts_implementation = "ours"
    assert engine.report(twin) == ours and engine.report(m) == [now]
    engine.revert(m)
    assert m.config._experts_implementation == "before" and twin.config._experts_implementation == "ours"


def test_iter_modules_prunes_and_visits_shared_once():
    shared = Scale(1.0)
    m = nn.Sequential(nn.Sequential(shared, Scale(2.0)), shared)
    assert [p for p, _ in engine.iter_modules(m)] == ["0", "0.0", "0.1"]
    # Pruned below "0", the shared module is first reached as "1".
    assert [p for p, _ in engine.iter_modules(m, prune=lambda p, mod: p == "0")] == ["0", "1"]


def test_report_str_and_counts():
    m = _model()
    engine.replace_forward(m, m[0], _double, path="0", kernel="dbl", source="t", detail="why")
    engine.replace_forward(m, m[1][0], _double, path="1.0", kernel="dbl", source="t")
    rep = engine.report(m)
    assert rep.counts() == {"dbl": 2}
    assert "0: forward -> dbl [t (why)]" in str(rep)
    engine.revert(m)
    assert str(engine.report(m)) == "no replacements"


def test_a_patched_model_is_freed_when_dropped():
    """The ledger references the model itself (a replaced root forward, a custom undo bound to it): it must not
    keep a dropped model, and its weights, alive."""
    m = _model()
    engine.replace_forward(m, m, lambda self, x: x, path="", kernel="identity", source="test")
    engine.record_custom(m, m, "flag", lambda: None, path="", what="attribute", kernel="k", source="test")
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def _set_flag(module, value):
    module.flag = value


def _changed_model():
    """A model with every kind of change: a forward, a module swap, a custom undo over the model's own objects."""
    m = _model()
    m.flag = "before"
    engine.replace_forward(m, m[0], _double, path="0", kernel="k", source="t")
    engine.replace_module(m, "1.0", Scale(20.0), kernel="Scale", source="t")
    m.flag = "after"
    engine.record_custom(
        m, m, "flag", functools.partial(_set_flag, m, "before"), path="", what="attribute", kernel="k", source="t"
    )
    return m


def test_a_deep_copy_reverts_on_its_own():
    m = _changed_model()
    x = torch.randn(5, generator=torch.Generator().manual_seed(3))
    ref = m(x)
    twin = copy.deepcopy(m)
    assert engine.report(twin) == engine.report(m)
    torch.testing.assert_close(twin(x), ref)
    undone = engine.revert(twin)
    assert [c.path for c in undone] == ["0", "1.0", ""]
    assert "forward" not in vars(twin[0]) and twin.flag == "before"
    torch.testing.assert_close(twin(x), x * 1.0 * 2.0 * 3.0)
    assert twin[1][0] is not m[1][0] and twin[1][0].s == 2.0  # the copy's own original module came back
    # the original still holds all of its changes
    assert engine.report(m).paths() == ["0", "1.0", ""] and m.flag == "after" and m[1][0].s == 20.0
    torch.testing.assert_close(m(x), ref)
    engine.revert(m)
    torch.testing.assert_close(m(x), x * 1.0 * 2.0 * 3.0)


def test_a_changed_model_does_not_pickle():
    m = _changed_model()
    with pytest.raises(TypeError, match=r"cannot pickle a model changed by tritonspec \(3 replacements.*revert"):
        pickle.dumps(m)
    engine.revert(m)
    pickle.loads(pickle.dumps(m))  # reverted: an ordinary model again


def test_shared_patch_goes_when_its_last_model_is_collected():
    holder = types.SimpleNamespace(fn=lambda: "orig")
    orig = holder.fn
    a, b = _model(), _model()
    engine.patch_attr(a, holder, "fn", lambda: "new", path="holder.fn", kernel="k", source="t", shared=True)
    engine.patch_attr(b, holder, "fn", lambda: "new", path="holder.fn", kernel="k", source="t", shared=True)
    del a
    gc.collect()
    assert holder.fn() == "new"  # b still holds it
    twin = copy.deepcopy(b)  # the copy holds it too
    del b
    gc.collect()
    assert holder.fn() == "new"
    engine.revert(twin)
    assert holder.fn is orig
    c = _model()
    engine.patch_attr(c, holder, "fn", lambda: "new", path="holder.fn", kernel="k", source="t", shared=True)
    del c
    gc.collect()
    assert holder.fn is orig and engine.shared_original(holder, "fn", "unpatched") == "unpatched"
