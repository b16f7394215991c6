"""The ServerArgs patch: PagedWeight turns SGLang's shared-expert fusion off (once, logged) and leaves it alone
when PagedWeight is off."""

from __future__ import annotations

import argparse
import logging

import pytest

patch = pytest.importorskip("pagedweight.patches.server_args")


class _Args:  # stands in for a ServerArgs instance (takes the private config attribute)
    pass


class _Recorder:
    def __init__(self):
        self.seen = None

    def from_cli(self, namespace):
        self.seen = dict(vars(namespace))
        return argparse.Namespace(**vars(namespace))

    def init(self, obj, **kwargs):
        self.seen = dict(kwargs)


def test_cli_with_paged_weight_disables_shared_expert_fusion(caplog, monkeypatch):
    monkeypatch.setattr(patch, "_validate_before_launch", lambda *a: None)  # no checkpoint here
    rec = _Recorder()
    ns = argparse.Namespace(enable_paged_weight=True, disable_shared_experts_fusion=False)
    with caplog.at_level(logging.INFO, logger=patch.__name__):
        patch.from_cli_args_around(rec.from_cli, ns)
    assert rec.seen["disable_shared_experts_fusion"] is True
    assert "--disable-shared-experts-fusion set" in caplog.text


def test_cli_without_paged_weight_keeps_fusion_and_says_nothing(caplog):
    rec = _Recorder()
    ns = argparse.Namespace(enable_paged_weight=False, disable_shared_experts_fusion=False)
    with caplog.at_level(logging.INFO, logger=patch.__name__):
        patch.from_cli_args_around(rec.from_cli, ns)
    assert rec.seen["disable_shared_experts_fusion"] is False and "shared-experts" not in caplog.text


def test_engine_kwargs_with_paged_weight_disable_fusion_once(caplog, monkeypatch):
    monkeypatch.setattr(patch, "_validate_before_launch", lambda *a: None)
    rec = _Recorder()
    with caplog.at_level(logging.INFO, logger=patch.__name__):
        patch.init_around(rec.init, _Args(), enable_paged_weight=True, model_path="m")
        assert rec.seen == {"model_path": "m", "disable_shared_experts_fusion": True}
        patch.init_around(rec.init, _Args(), enable_paged_weight=True, disable_shared_experts_fusion=True)
    assert rec.seen == {"disable_shared_experts_fusion": True}
    assert caplog.text.count("--disable-shared-experts-fusion set") == 1  # already set: nothing to say
