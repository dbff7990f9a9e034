"""Downloading a model from a Hugging Face hub into the local hub cache.

    path = fetch("mlx-community/Qwen3-4B-4bit")           # -> the snapshot folder, ready for mlx_lm.load
    PROGRESS.snapshot()   # {"repo", "state", "bytes_done", "bytes_total", ...} (the server's /health)

Only the files MLX loads are fetched (``MLX_PATTERNS``: safetensors weights, JSON configs, tokenizer
files, chat templates); PyTorch / GGUF / ONNX weights beside them are left on the hub. Before any byte
is fetched the files still missing are summed from the hub's own listing of the revision
(``model_info(files_metadata=True)``) and compared with the free disk of the cache: a short disk is
one error, not a half-written snapshot. huggingface_hub resumes a file whose connection broke
(a Range request for the rest), and a rerun fetches only the files not yet complete.

The endpoint (``HF_ENDPOINT``) and the cache (``HF_HUB_CACHE`` / ``HF_HOME``) are read from the
environment at each call, not at huggingface_hub's import, so one process can be pointed at another
hub. ``HF_TOKEN`` is read by huggingface_hub itself and never appears here.

The server runs with the hub switched off (``hf_offline_env``): a fetch lifts that switch for its own
duration only, and only where the stack set it -- an ``HF_HUB_OFFLINE=1`` the user set is obeyed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .loaded import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
# What mlx-lm / mlx-vlm read from a model folder. Not *.bin / *.pth / *.gguf / *.onnx / *.msgpack / *.h5:
# other frameworks' copies of the same weights.
MLX_PATTERNS = ("*.safetensors", "*.json", "*.jsonl", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
# Set (to "1") by hf_offline_env when the stack itself switched the hub off, so a fetch may lift it.
OFFLINE_DEFAULTED = "MLX_STACK_HF_OFFLINE_DEFAULTED"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class FetchError(ModelLoadError):
    """A model could not be fetched; the message names the repo, the endpoint and what to do.
    ``kind``: unreachable | offline | gated | no_revision | not_found | not_mlx | http | disk | download."""

    def __init__(self, message: str, kind: str = "download") -> None:
        super().__init__(message)
        self.kind = kind


def looks_like_repo_id(value: str) -> bool:
    """``owner/name`` as the hub spells it (not a path: no leading '/', '.', '~', one slash)."""
    return bool(_REPO_ID.match(value.strip())) and ".." not in value


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use with this environment (its own order of variables)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(env["HF_HUB_CACHE"])).expanduser()
    if env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.path.expandvars(env["HUGGINGFACE_HUB_CACHE"])).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def repo_folder(repo: str, cache: Path | None = None) -> Path:
    """Where the hub cache keeps ``repo`` (``models--owner--name``)."""
    return (cache or hub_cache_dir()) / ("models--" + repo.replace("/", "--"))


def disk_free(path: Path) -> int:
    """Free bytes on the volume that holds ``path`` (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


@dataclass
class FetchProgress:
    """The current (or last) fetch of this process, safe to read from any thread."""

    repo: str = ""
    revision: str = ""
    state: str = "idle"            # idle | checking | downloading | done | failed
    bytes_done: int = 0
    bytes_total: int = 0
    files_total: int = 0
    error: str = ""
    started: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, repo: str, revision: str) -> None:
        with self._lock:
            self.repo, self.revision, self.state = repo, revision, "checking"
            self.bytes_done = self.bytes_total = self.files_total = 0
            self.error, self.started = "", time.time()

    def reset(self) -> None:
        with self._lock:
            self.repo, self.revision, self.state, self.error, self.started = "", "", "idle", "", 0.0
            self.bytes_done = self.bytes_total = self.files_total = 0

    def update(self, **values: Any) -> None:
        with self._lock:
            for key, value in values.items():
                setattr(self, key, value)

    def snapshot(self) -> dict:
        with self._lock:
            out = {"repo": self.repo, "revision": self.revision, "state": self.state,
                   "bytes_done": self.bytes_done, "bytes_total": self.bytes_total, "files": self.files_total,
                   "elapsed_s": round(time.time() - self.started, 1) if self.started else 0.0}
            if self.error:
                out["error"] = self.error
            return out


PROGRESS = FetchProgress()
_OFFLINE_LOCK = threading.Lock()


@contextlib.contextmanager
def hub_reachable(repo: str) -> Iterator[None]:
    """huggingface_hub's offline switch off for the duration of a fetch, where the stack set it
    (hf_offline_env); an offline mode the user asked for is an error naming the variable."""
    from huggingface_hub import constants

    ours = os.environ.get(OFFLINE_DEFAULTED) == "1"
    asked = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
             if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")]
    if asked and not ours:
        raise FetchError(f"{repo} is not in the local Hugging Face cache ({hub_cache_dir()}) and {asked[0]}=1 is set, "
                         f"so it cannot be downloaded: unset {asked[0]} to let the stack fetch it, or download it "
                         "elsewhere and copy the cache.", "offline")
    with _OFFLINE_LOCK:
        before = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = False
        try:
            yield
        finally:
            constants.HF_HUB_OFFLINE = before


def _bar_class(progress: FetchProgress, console: bool, say: Callable[[str], None]) -> type:
    """A tqdm class for snapshot_download: its bytes-written bar also feeds ``progress`` and says
    each tenth of the total (for logs that are not a terminal, where tqdm draws nothing); ``console``
    off draws no bar at all."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Bar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._feeds = kwargs.get("name") == "huggingface_hub.snapshot_download"   # the bytes written
            self._bytes, self._tenth = 0, 0
            if not console:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._feeds and n:       # counted here: a disabled bar (no terminal) counts nothing
                self._bytes += int(n)
                progress.update(bytes_done=self._bytes)
                total = progress.bytes_total
                tenth = min(10, 10 * self._bytes // total) if total else 0
                if tenth > self._tenth:
                    self._tenth = tenth
                    say(f"downloading {progress.repo}: {gib(self._bytes)} of {gib(total)} ({10 * tenth}%)")
            return super().update(n)

    return Bar


def _cached(folder: Path, commit: str, filename: str) -> bool:
    return (folder / "snapshots" / commit / filename).is_file()


def fetch(repo: str, revision: str | None = None, *, console: bool = True,
          say: Callable[[str], None] | None = None, progress: FetchProgress = PROGRESS) -> Path:
    """Download what MLX needs of ``repo`` at ``revision`` (default: main) into the hub cache; the
    snapshot folder. Raises FetchError (one message: repo, endpoint, why, what to do); ``progress``
    holds the state throughout (``failed`` with the same message)."""
    progress.begin(repo, revision or "main")
    try:
        path = _fetch(repo, revision, console, say or log.info, progress)
    except FetchError as exc:
        progress.update(state="failed", error=str(exc))
        raise
    progress.update(state="done")
    return path


@dataclass(frozen=True)
class RemoteRepo:
    """What the hub says of a model repo at a revision: its commit and the sizes of the files MLX loads."""
    repo: str
    commit: str
    sizes: dict[str, int]

    @property
    def weights_bytes(self) -> int:
        return sum(n for name, n in self.sizes.items() if name.endswith(".safetensors"))


def remote_repo(repo: str, revision: str | None = None) -> RemoteRepo:
    """Ask the hub (HF_ENDPOINT) for ``repo``'s MLX files and their sizes, fetching nothing;
    FetchError naming why it cannot be used (unreachable, gated, no such repo or revision, no
    config.json or .safetensors weights)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import filter_repo_objects

    endpoint, rev = hub_endpoint(), revision or "main"
    where = f"the Hugging Face hub at {endpoint} (HF_ENDPOINT)"
    with hub_reachable(repo):
        try:
            info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True)
        except (httpx.ConnectError, httpx.TimeoutException, OfflineModeIsEnabled) as exc:
            raise FetchError(f"cannot download {repo}: {where} cannot be reached ({type(exc).__name__}: {exc}). "
                             "Check the network (or HF_ENDPOINT), or download the model on another machine into "
                             "the Hugging Face cache and copy it here.", "unreachable") from None
        except GatedRepoError:
            raise FetchError(f"cannot download {repo}: it is gated on {where}; accept its licence on the hub "
                             "and set HF_TOKEN in the environment.", "gated") from None
        except RevisionNotFoundError:
            raise FetchError(f"cannot download {repo}: {where} has no revision {rev!r} of it.", "no_revision") from None
        except RepositoryNotFoundError:
            raise FetchError(f"cannot download {repo}: {where} has no model repo of that name (or it is "
                             "private: set HF_TOKEN). Check the spelling (owner/name).", "not_found") from None
        except HfHubHTTPError as exc:
            raise FetchError(f"cannot download {repo}: {where} answered HTTP {_status(exc)}; try again "
                             "later.", "http") from None
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
    wanted = sorted(filter_repo_objects(sizes, allow_patterns=list(MLX_PATTERNS)))
    if "config.json" not in wanted:
        raise FetchError(f"cannot use {repo}: it has no config.json on {where}; it is not a model repo "
                         "MLX can load.", "not_mlx")
    if not any(name.endswith(".safetensors") for name in wanted):
        raise FetchError(f"cannot use {repo}: it has no .safetensors weights on {where} (MLX loads only "
                         "those; .bin / .gguf / .onnx are not fetched). Pick an MLX conversion of the model, "
                         "e.g. one under mlx-community/.", "not_mlx")
    return RemoteRepo(repo, info.sha or rev, {name: sizes[name] for name in wanted})


def _fetch(repo: str, revision: str | None, console: bool, say: Callable[[str], None],
           progress: FetchProgress) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    endpoint, cache = hub_endpoint(), hub_cache_dir()
    rev = revision or "main"
    where = f"the Hugging Face hub at {endpoint} (HF_ENDPOINT)"
    remote = remote_repo(repo, revision)
    commit, sizes, wanted = remote.commit, remote.sizes, sorted(remote.sizes)
    with hub_reachable(repo):
        folder = repo_folder(repo, cache)
        missing = [name for name in wanted if not _cached(folder, commit, name)]
        need = sum(sizes[name] for name in missing)
        free = disk_free(cache)
        if need > free:
            raise FetchError(f"cannot download {repo}: its {len(missing)} missing files need {gib(need)} and "
                             f"{cache} has {gib(free)} free. Free some space, or point HF_HUB_CACHE (or HF_HOME) "
                             "at a larger disk.", "disk")
        progress.update(state="downloading", bytes_total=need, files_total=len(missing))
        if missing:
            say(f"downloading {repo} ({rev}) from {endpoint}: {len(missing)} files, {gib(need)}")
        try:
            path = snapshot_download(repo, revision=revision, cache_dir=str(cache), endpoint=endpoint,
                                     allow_patterns=list(MLX_PATTERNS), tqdm_class=_bar_class(progress, console, say))
        except HfHubHTTPError as exc:       # before OSError / httpx.HTTPError: it is both
            raise FetchError(f"downloading {repo} from {where} failed: HTTP {_status(exc)}; run it again to "
                             "resume (files already complete are kept).") from None
        except Exception as exc:  # noqa: BLE001 - a broken connection, a full disk: one message
            raise FetchError(f"downloading {repo} from {where} failed ({type(exc).__name__}: {exc}); run it "
                             "again to resume (files already complete are kept).") from None
    say(f"{repo} ({rev}) ready in {path}")
    return Path(path)


def _status(exc: Any) -> Any:
    response = getattr(exc, "response", None)
    return response.status_code if response is not None else "?"
