"""``DisaggregatedTrainer``: a Ray Train trainer with one worker group per model module."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

import ray
from ray.train import Checkpoint, Result, RunConfig, ScalingConfig

from ray_disagg._internal import ray_compat as rc
from ray_disagg._internal.controller import DisaggregatedController
from ray_disagg._internal.ingest import is_ray_dataset
from ray_disagg._internal.loop_common import LoopArgs
from ray_disagg._internal.text_loop import text_train_loop
from ray_disagg._internal.validation import validate_layout
from ray_disagg._internal.vision_loop import vision_train_loop
from ray_disagg._internal.worker_groups import GroupLaunch
from ray_disagg.backend import TextBackendConfig, VisionBackendConfig
from ray_disagg.config import ModuleGroup, TensorParallel, TrainLoopConfig
from ray_disagg.data import BatchPlan, validate_sample
from ray_disagg.model import Qwen2_5_VLSpec

__all__ = ["DisaggregatedTrainer"]

MODULES = ("vision", "text")


def _not_called(*_args, **_kwargs):
    raise RuntimeError("DisaggregatedTrainer runs its own per-group training loops.")


class DisaggregatedTrainer(rc.DataParallelTrainer):
    """Train a vision-language model with one Ray Train worker group per module.

    The ``"vision"`` group runs the vision tower + merger, the ``"text"`` group the LLM
    (embeddings, decoder, lm_head, loss). Each group has its own ``ScalingConfig``,
    parallelism and torch process group; image embeddings flow vision -> text and their
    gradients text -> vision every step. ``fit()`` returns one ``ray.train.Result`` whose
    checkpoint holds ``vision/`` and ``text/`` shards plus the HF ``config.json``.

    Restarts (``FailureConfig(max_failures=K)``) and a rerun with the same
    ``RunConfig(name=..., storage_path=...)`` continue from the latest checkpoint;
    ``resume_from_checkpoint`` starts from a given one (of any layout).

    Example:
        >>> import ray
        >>> from ray.train import RunConfig, ScalingConfig
        >>> from ray_disagg import DisaggregatedTrainer, ModuleGroup, Qwen2_5_VLSpec
        >>> from ray_disagg import tiny_qwen2_5_vl_config
        >>> from ray_disagg.examples_data import digits_samples
        >>> cfg = tiny_qwen2_5_vl_config()
        >>> trainer = DisaggregatedTrainer(  # doctest: +SKIP
        ...     model=Qwen2_5_VLSpec(config=cfg),
        ...     groups={
        ...         "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
        ...         "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
        ...     },
        ...     train_loop_config={"lr": 1e-3, "max_steps": 20, "global_batch_size": 4},
        ...     datasets={"train": digits_samples(cfg, n=64)},
        ...     run_config=RunConfig(name="tiny-vlm", storage_path="/tmp/ray_disagg_runs"),
        ... )
        >>> result = trainer.fit()  # doctest: +SKIP
        >>> result.metrics["loss"]  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        model: Qwen2_5_VLSpec,
        groups: Mapping[str, ModuleGroup],
        train_loop_config: TrainLoopConfig | dict[str, Any] | None = None,
        datasets: Mapping[str, Any] | None = None,
        run_config: RunConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validate_samples: bool = True,
    ):
        if not isinstance(model, Qwen2_5_VLSpec):
            raise ValueError(
                f"model must be a Qwen2_5_VLSpec (config= or pretrained_path=), got "
                f"{type(model).__name__}."
            )
        self.model_spec = model
        if resume_from_checkpoint is not None and not isinstance(
            resume_from_checkpoint, Checkpoint
        ):
            raise ValueError("resume_from_checkpoint must be a ray.train.Checkpoint.")
        self.resume_from_checkpoint = resume_from_checkpoint
        self.groups = self._validate_groups(groups)
        self.loop_config = TrainLoopConfig.from_any(train_loop_config)
        hf_config = model.load_config()
        validate_layout(hf_config, self.groups)
        self._hf_config = hf_config
        self._train_data = self._validate_datasets(datasets, hf_config, validate_samples)
        self._samples_validated = validate_samples and not is_ray_dataset(self._train_data)
        self.plan = BatchPlan(
            num_samples=self._num_samples(self._train_data, self.groups["vision"].dp_size),
            global_batch_size=self.loop_config.global_batch_size,
            vision_dp=self.groups["vision"].dp_size,
            text_dp=self.groups["text"].dp_size,
            seed=self.loop_config.seed,
            shuffle=self.loop_config.shuffle,
        )
        total = sum(g.num_workers for g in self.groups.values())
        super().__init__(
            _not_called,
            train_loop_config={"ray_disagg": True},
            scaling_config=ScalingConfig(num_workers=total),
            run_config=run_config,
        )

    @staticmethod
    def _validate_groups(groups: Mapping[str, ModuleGroup] | None) -> dict[str, ModuleGroup]:
        if not isinstance(groups, Mapping):
            raise ValueError('groups must be a dict {"vision": ModuleGroup, "text": ModuleGroup}.')
        unknown = sorted(set(groups) - set(MODULES))
        if unknown:
            raise ValueError(
                f"Unknown module group(s) {unknown}; Qwen2.5-VL has groups {list(MODULES)}."
            )
        missing = [m for m in MODULES if m not in groups]
        if missing:
            raise ValueError(
                f"Missing module group(s) {missing}: give a ModuleGroup for each of "
                f"{list(MODULES)}."
            )
        for name, g in groups.items():
            if not isinstance(g, ModuleGroup):
                raise ValueError(f"groups[{name!r}] must be a ModuleGroup, got {type(g).__name__}.")
        return {m: groups[m] for m in MODULES}

    @staticmethod
    def _validate_datasets(datasets, hf_config, validate_samples: bool):
        if not datasets or "train" not in datasets:
            raise ValueError('datasets={"train": ...} is required.')
        extra = sorted(set(datasets) - {"train"})
        if extra:
            raise ValueError(f"Only a 'train' dataset is supported, got extra keys {extra}.")
        data = datasets["train"]
        if is_ray_dataset(data):
            return data  # streamed by the vision group; each row is validated when read
        if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
            raise ValueError(
                "datasets['train'] must be a ray.data.Dataset or a map-style dataset (list of "
                f"sample dicts, datasets.Dataset, ...), got {type(data).__name__}."
            )
        if len(data) == 0:
            raise ValueError("datasets['train'] is empty.")
        if validate_samples:
            merge = hf_config.vision_config.spatial_merge_size
            for i in range(len(data)):
                validate_sample(
                    data[i],
                    image_token_id=hf_config.image_token_id,
                    spatial_merge_size=merge,
                    index=i,
                )
        return data

    @staticmethod
    def _num_samples(data, vision_dp: int) -> int:
        if not is_ray_dataset(data):
            return len(data)
        n = data.count()
        if n == 0:
            raise ValueError("datasets['train'] is empty.")
        return n - n % vision_dp  # streaming_split(equal=True) drops the remainder

    # ---- Ray Train hooks ------------------------------------------------------------

    def _create_default_callbacks(self):
        # Backend/accelerator setup is per group (added by the coordinator); data is read
        # by the vision group, not sharded by Ray Train's DatasetsCallback.
        dropped = (rc.AcceleratorSetupCallback, rc.BackendSetupCallback, rc.DatasetsCallback)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

    def _launches(self) -> dict[str, GroupLaunch]:
        args = LoopArgs(
            spec=self.model_spec,
            cfg=self.loop_config,
            vision=self.groups["vision"],
            text=self.groups["text"],
            plan=self.plan,
            image_token_id=self._hf_config.image_token_id,
            spatial_merge_size=self._hf_config.vision_config.spatial_merge_size,
            text_hidden=self._hf_config.text_config.hidden_size,
            dataset_ref=[ray.put(self._train_data)],
            resume_from_checkpoint=self.resume_from_checkpoint,
            samples_validated=self._samples_validated,
        )
        loops = {"vision": vision_train_loop, "text": text_train_loop}
        backends = {"vision": VisionBackendConfig, "text": TextBackendConfig}
        launches = {}
        for name, group in self.groups.items():
            # vision: "sp" unless it is tensor parallel (the uniform-TP baseline); text: "tp"
            sp_axis = name == "vision" and not isinstance(group.parallelism, TensorParallel)
            mp_axis = "sp" if sp_axis else "tp"
            backend = backends[name](
                mesh_shape=(group.dp_size, group.model_parallel_size),
                mesh_axes=("dp", mp_axis),
                timeout_s=int(self.loop_config.collective_timeout_s),
            )
            fn = rc.construct_train_func(
                functools.partial(loops[name], args),
                config=None,
                train_func_context=backend.train_func_context,
                fn_arg_name="train_loop_per_worker",
            )
            launches[name] = GroupLaunch(
                name=name,
                scaling_config=group.scaling_config,
                backend_config=backend,
                train_fn_ref=rc.ObjectRefWrapper(fn),
            )
        return launches

    def _initialize_and_run_controller(self, **controller_init_kwargs) -> Result:
        controller = rc.run_controller_actor(
            DisaggregatedController,
            launches=self._launches(),
            side_timeout_s=self.loop_config.collective_timeout_s,
            **controller_init_kwargs,
        )
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
