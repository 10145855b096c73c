# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""The umbrella re-exports the same objects the packages define."""

import hp_dtensor
import hp_ep
import hp_fsdp
import hp_pp
import hp_tp
import hyper_parallel


def test_umbrella_exports_are_the_package_objects() -> None:
    packages = (hp_tp, hp_fsdp, hp_ep, hp_pp, hp_dtensor)
    for name in hyper_parallel.__all__:
        sources = [p for p in packages if name in p.__all__]
        assert sources, f"{name} is exported by the umbrella but by none of {[p.__name__ for p in packages]}"
        assert getattr(hyper_parallel, name) is getattr(sources[0], name), name


def test_seven_styles_are_parallel_styles() -> None:
    names = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
             "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel"]
    for name in names:
        assert issubclass(getattr(hyper_parallel, name), hyper_parallel.ParallelStyle), name


def test_umbrella_has_no_protocol_symbols() -> None:
    assert not hasattr(hyper_parallel, "Configurable")


def test_pipeline_api_is_reexported() -> None:
    names = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZeroBubble",
             "split_layers", "PipelineConfigError"]
    for name in names:
        assert name in hyper_parallel.__all__ and getattr(hyper_parallel, name) is getattr(hp_pp, name), name
