"""Upload a finished merge to the Hugging Face Hub (verl's --hf_upload_path): huggingface_hub's own API, imported
only here and only when asked (`pip install 'distmerge[hub]'`).

One process (rank 0), after the merge: the index is the commit marker, so a folder without it is never uploaded.
HF_ENDPOINT names another hub (a mirror, or a test's local server); the token is huggingface_hub's (HF_TOKEN or
`hf auth login`).
"""

from __future__ import annotations

import os
from pathlib import Path

from distmerge.errors import DistmergeError
from distmerge.output.names import INDEX_NAME, RECORDS

NOT_UPLOADED = [f"{RECORDS}/*"]  # --resume's records: of this machine's run, not of the model


class HubError(DistmergeError):
    """The upload to the Hugging Face Hub failed; the merged model is complete on disk."""


def upload(folder: Path, repo: str, private: bool, revision: str | None = None) -> str:
    """Create the model repository `repo` if needed (private when asked) and commit the folder to it: to its main
    branch, or to the branch `revision`, made from main if needed (`distmerge watch`: a branch per step). Returns
    the commit's URL."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    except ImportError:
        raise HubError("--hf_upload_path needs huggingface_hub: pip install 'distmerge[hub]' (the merged model "
                       f"is complete in {folder})") from None
    if not (folder / INDEX_NAME).is_file():
        raise HubError(f"{folder} has no {INDEX_NAME}: the merge did not finish, nothing was uploaded")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        if revision is not None:
            api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo, repo_type="model", revision=revision,
                                   commit_message="Upload model merged by distmerge", ignore_patterns=NOT_UPLOADED)
    except HFValidationError:
        raise HubError(f"--hf_upload_path {repo!r} is not a Hugging Face repository id: pass NAME or USER/NAME"
                       ) from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        raise HubError(f"the Hugging Face Hub at {api.endpoint} refused the upload to {repo} (HTTP {status}): check "
                       f"the repository name and your token (HF_TOKEN); the merged model is complete in {folder}"
                       ) from None
    except Exception as err:  # noqa: BLE001  (httpx's transport errors and OSError alike: the hub is unreachable)
        first = (str(err).splitlines() or [""])[0][:200]
        raise HubError(f"cannot reach the Hugging Face Hub at {api.endpoint} ({type(err).__name__}: {first}); "
                       f"the merged model is complete in {folder}: upload it later with `hf upload {repo} "
                       f"{folder}`") from None
    return str(commit.commit_url)
