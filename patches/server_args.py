"""ServerArgs integration: the --paged-weight-* flags, Engine(**kwargs), and validation before launch.

The config is stored as the private attribute `_paged_weight` (ServerArgs rejects new public attributes
after resolution), set with object.__setattr__; ServerArgs is pickled into every scheduler process whole.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pagedweight import config as pw_config

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.server_args.ServerArgs"
_FUSION_FLAG = "disable_shared_experts_fusion"


def get_config(server_args: Any) -> pw_config.PagedWeightConfig:
    cfg = getattr(server_args, pw_config.SERVER_ARGS_ATTR, None)
    return cfg if cfg is not None else pw_config.PagedWeightConfig()


def _attach(server_args: Any, cfg: pw_config.PagedWeightConfig) -> None:
    object.__setattr__(server_args, pw_config.SERVER_ARGS_ATTR, cfg)


def add_cli_args_after(result, parser, *args, **kwargs):
    pw_config.add_cli_args(parser)
    return result


def _unfuse_shared_experts(values: Any, get, put) -> None:
    """PagedWeight serves routed experts from AP planes and a shared expert as its own MLP; SGLang fuses the
    shared expert into the routed kernel on CUDA (GLM-4.5, DeepSeek) unless told not to. Set the flag, say so."""
    if not get(values):
        put(values)
        logger.info("PagedWeight: --disable-shared-experts-fusion set (AP experts run apart from any shared expert)")


def from_cli_args_around(original, *args, **kwargs):
    # classmethod: args = (namespace,) once bound; tolerate (cls, namespace) too.
    from pagedweight.serving.startup_check import PagedWeightStartupError

    namespace = args[-1] if args else kwargs["args"]
    try:
        cfg = pw_config.from_namespace(namespace)
        if cfg.enable:
            _unfuse_shared_experts(namespace, lambda ns: getattr(ns, _FUSION_FLAG, False),
                                   lambda ns: setattr(ns, _FUSION_FLAG, True))
        server_args = original(*args, **kwargs)
        _attach(server_args, cfg)
        if cfg.enable:
            _validate_before_launch(server_args, cfg)
    except (pw_config.PagedWeightConfigError, PagedWeightStartupError) as e:
        # Command line: one clear line and a non-zero exit, like argparse; nothing has been started yet.
        raise SystemExit(f"PagedWeight error: {e}") from None
    return server_args


def init_around(original, self, *args, **kwargs):
    """ServerArgs(**kwargs) as built by sglang.Engine(**kwargs): accept and strip our keys."""
    cfg: Optional[pw_config.PagedWeightConfig] = pw_config.pop_kwargs(kwargs)
    if cfg is not None and cfg.enable:
        _unfuse_shared_experts(kwargs, lambda kw: kw.get(_FUSION_FLAG, False), lambda kw: kw.__setitem__(_FUSION_FLAG, True))
    original(self, *args, **kwargs)
    if cfg is not None:
        _attach(self, cfg)
        if cfg.enable:
            _validate_before_launch(self, cfg)


def _validate_before_launch(server_args: Any, cfg: pw_config.PagedWeightConfig) -> None:
    """Refuse bad input in the launching process, before any scheduler process is started."""
    from pagedweight.serving.startup_check import check_paged_weight_launch

    check_paged_weight_launch(server_args, cfg)


def register(registry, hook_type) -> None:
    registry.register(f"{TARGET}.add_cli_args", add_cli_args_after, hook_type.AFTER)
    registry.register(f"{TARGET}.from_cli_args", from_cli_args_around, hook_type.AROUND)
    registry.register(f"{TARGET}.__init__", init_around, hook_type.AROUND)
