"""The PPO trainer's checkpoints: whose folder it is, a verified save, resume with fallback.

* Identity: every checkpoint's meta.json carries the run id and the config fingerprint
  (hybridrl.utils.checkpointing.config_digest). At start-up the folder must be empty, or hold
  this run's checkpoints (same fingerprint, `resume_mode=auto`), or the one named by
  `resume_mode=resume_path`; otherwise the run stops, naming the keys that differ and the keys
  to change. A resumed run keeps the run id of what it resumed.
* Save: the workers write into `global_step_N.tmp`; the driver checks that every rank's part is
  there (as the driver sees the filesystem), writes meta.json with a manifest, and finalizes
  (fsync, rename, latest file). Pruning only touches this run's folders and never the new one
  or the one the latest file names. `del_local_ckpt_after_load` deletes the loaded folder only
  after the next successful save.
* Resume: candidates best first (the latest file's, then newer-to-older); one that is
  incomplete (manifest) or fails to load is reported and the next older one is tried.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

from hybridrl.trainer.ppo.teachers import teacher_meta
from hybridrl.utils import checkpointing as ck
from hybridrl.utils import storage

__all__ = ["CheckpointDirError", "RunCheckpoints"]

_NEW_FOLDER_KEYS = "trainer.default_local_dir (or trainer.experiment_name / trainer.project_name)"


class CheckpointDirError(RuntimeError):
    """trainer.default_local_dir holds checkpoints this run must not write beside or resume."""


class RunCheckpoints:
    """Checkpoint bookkeeping of one run (on the driver).

    Args:
        config: the whole typed config (its identity keys are fingerprinted).
    """

    def __init__(self, config: Any) -> None:
        self.tr = config.trainer
        self.root = os.path.abspath(os.path.expanduser(self.tr.default_local_dir))
        self.digest = ck.config_digest(config)
        self.fingerprint = ck.fingerprint(self.digest)
        self.experiment = f"{self.tr.project_name}/{self.tr.experiment_name}"
        self.run_id: str | None = None
        self.teachers = teacher_meta(config)  # distillation teachers' paths (they are not checkpointed)
        self._delete_after_save: str | None = None
        self._plan: list[str] | None = None

    # ------------------------------------------------------------------------- start-up
    def plan_resume(self) -> list[str]:
        """Checkpoint folders to try, best first ([] = start fresh); decides the run id.

        Called before Ray starts (setup.build_trainer) and again by the trainer: the first
        answer is kept.

        Raises:
            CheckpointDirError: the folder holds another run's checkpoints (names the keys).
        """
        if self._plan is None:
            self._plan = self._plan_resume()
        return list(self._plan)

    def _plan_resume(self) -> list[str]:
        restored = ck.restore_interrupted(self.root)
        for path in restored:
            print(f"[hybridrl] put back {path} (a save had moved it aside and did not finish)")
        mode = self.tr.resume_mode
        if mode == "resume_path":
            path = os.path.abspath(os.path.expanduser(self.tr.resume_from_path or ""))
            if not self.tr.resume_from_path or not os.path.isdir(path):
                raise FileNotFoundError(
                    f"trainer.resume_mode=resume_path but trainer.resume_from_path={self.tr.resume_from_path!r} "
                    "is not a folder; point it at a global_step_<N> checkpoint or use trainer.resume_mode=auto"
                )
            ck.step_of(path)
            meta = ck.read_meta(path) or {}
            self._adopt(meta, path, strict=False)
            return [path]
        found = ck.candidates(self.root)
        if not found:
            self.run_id = uuid.uuid4().hex[:12]
            return []
        meta = ck.read_meta(found[0]) or {}
        if mode == "disable":
            raise CheckpointDirError(
                f"trainer.resume_mode=disable but trainer.default_local_dir={self.root} already holds "
                f"checkpoints ({os.path.basename(found[0])}, run {meta.get('run_id', 'unknown')}); a new run "
                f"there would be mixed with them. Set {_NEW_FOLDER_KEYS} to a folder of its own, or "
                "continue that run with trainer.resume_mode=auto"
            )
        self._adopt(meta, found[0], strict=True)
        if meta.get("run_id"):
            found = [p for p in found if (ck.read_meta(p) or {}).get("run_id") == meta["run_id"]]
        return found

    def _adopt(self, meta: dict, path: str, strict: bool) -> None:
        """Continue the run of checkpoint `path` (refused, when `strict`, if its config differs)."""
        theirs = meta.get("config_digest")
        keys = ck.differing_keys(theirs, self.digest) if theirs is not None else []
        if keys:
            shown = ", ".join(keys[:12]) + (f" (+{len(keys) - 12} more)" if len(keys) > 12 else "")
            msg = (
                f"{path} belongs to run {meta.get('run_id')} ({meta.get('experiment')}) whose config "
                f"differs from this one in: {shown}"
            )
            if strict:
                raise CheckpointDirError(
                    f"trainer.default_local_dir={self.root} holds the checkpoints of another run: {msg}. "
                    f"Set {_NEW_FOLDER_KEYS} to a folder of its own, or, to continue that run on purpose, "
                    f"trainer.resume_mode=resume_path trainer.resume_from_path={path}"
                )
            print(f"[hybridrl] warning: resuming {msg}")
        if theirs is None:
            print(f"[hybridrl] warning: {path} has no run identity (older layout); resuming it as this run")
        self.run_id = meta.get("run_id") or uuid.uuid4().hex[:12]

    def loaded(self, path: str) -> None:
        """Record a successful resume from `path` (for `del_local_ckpt_after_load`)."""
        if self.tr.del_local_ckpt_after_load:
            self._delete_after_save = path

    # ------------------------------------------------------------------------- save
    def last_good(self) -> str | None:
        """The newest complete checkpoint of the folder (what the latest file names), or None."""
        step = ck.latest_pointer(self.root)
        path = ck.step_dir(self.root, step) if step else None
        return path if path and os.path.isdir(path) else None

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[str]:
        """`begin_save` + storage faults named: yields the `.tmp` folder to write (and finish) in.

        Before writing, the free space is checked against the previous checkpoint's size; a failed
        write (full disk, I/O error, permission, vanished mount) removes the partial folder and
        raises StorageError naming the folder, the bytes needed and free, and the last good
        checkpoint (untouched: the latest file still names it).
        """
        last_good = self.last_good()
        needed = storage.dir_size(last_good) if last_good else 0
        what = f"saving checkpoint step {step}"
        storage.check_free_space(self.root, needed, what, last_good)
        tmp = None
        try:
            with storage.named_storage_faults(what, self.root, needed=needed or None, last_good=last_good):
                tmp = self.begin_save(step)
                yield tmp
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def begin_save(self, step: int) -> str:
        """A clean `global_step_N.tmp` for the workers to write into; returns its path."""
        tmp = ck.tmp_step_dir(self.root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    def finish_save(self, step: int, parts: dict[str, int]) -> str:
        """Verify every rank's part, write meta.json, finalize, prune; returns the final folder.

        Args:
            parts: part folder ('actor', 'critic') -> number of ranks that wrote it.
        """
        tmp = ck.tmp_step_dir(self.root, step)
        for part, world in parts.items():
            check_part(os.path.join(tmp, part), part, world, step)
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex[:12]
        ck.write_meta(
            tmp,
            {
                "format": 1,
                "run_id": self.run_id,
                "experiment": self.experiment,
                "config_fingerprint": self.fingerprint,
                "config_digest": self.digest,
                "global_step": step,
                "parts": sorted(parts),
                **({"distillation_teachers": self.teachers} if self.teachers else {}),
            },
        )
        final = ck.finalize(self.root, step)
        keep = 1 if self.tr.remove_previous_ckpt_in_save else self.tr.max_actor_ckpt_to_keep
        ck.prune(self.root, keep, run_id=self.run_id, protect={step})
        if "critic" in parts:
            ck.prune_part(
                self.root, "critic", self.tr.max_critic_ckpt_to_keep, run_id=self.run_id, protect={step}
            )
        doomed, self._delete_after_save = self._delete_after_save, None
        if doomed and os.path.normpath(doomed) != os.path.normpath(final) and os.path.isdir(doomed):
            shutil.rmtree(doomed, ignore_errors=True)
            print(f"[hybridrl] deleted {doomed}, loaded at start-up (trainer.del_local_ckpt_after_load)")
        return final


def check_part(path: str, part: str, world: int, step: int) -> None:
    """Every rank of a worker group wrote its share of `path` where the driver can see it."""
    meta = ck.read_meta(path)
    where = (
        "every worker must write where the driver can read (trainer.default_local_dir on a filesystem "
        "all nodes share)"
    )
    if meta is None:
        raise RuntimeError(f"checkpoint step {step}: {path}/meta.json (rank 0 of {part}) is missing; {where}")
    saved = int(meta.get("world_size") or world)
    if "extra" in meta.get("contents", []):
        for r in range(max(saved, world)):
            if not os.path.exists(os.path.join(path, f"extra_state_rank{r}.pt")):
                raise RuntimeError(
                    f"checkpoint step {step}: rank {r} of {part} wrote no extra_state_rank{r}.pt under {path}; "
                    f"{where}"
                )
