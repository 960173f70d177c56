"""The files a job spec names, on Kubernetes: the pods do not share the submitting machine's filesystem.

``streamrover run job.yaml --platform k8s`` reads the spec as written (relative paths not yet resolved) and:

* a relative ``trainer.script`` is **shipped**: its text goes into the ``StreamTrainJob`` (``spec.files``),
  the operator puts it in a ConfigMap ``<job>-files`` the resource owns, mounted read-only at
  :data:`FILES_MOUNT` in every node pod, and the spec the operator runs names it there;
* an absolute ``trainer.script`` is taken to be on the image (or on a volume every pod mounts), as it is;
* a relative ``checkpoint.url`` or dataset ``uri`` is **refused**: every pod reads and writes them while the
  job runs, so they must be URLs every pod reaches (``s3://``, ``kafka://``...) or absolute paths on a
  volume every pod mounts. (Locally and on Ray they resolve against the spec file's directory.)
* ``master.tls`` files are **refused**: on Kubernetes it names Secrets (:mod:`streamrover.operator.k8s_tls`).
"""

from __future__ import annotations

import re
from pathlib import Path

from streamrover.operator.spec import JobSpec, SpecError

FILES_MOUNT = "/var/run/streamrover/job"  # where a node pod finds the shipped files
FILES_VOLUME = "job-files"
MAX_BYTES = 512 * 1024  # the resource and its ConfigMap stay far below etcd's 1.5 MiB object limit
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # a ConfigMap key


def _local_relative(path: str | None) -> bool:
    return bool(path) and "://" not in str(path) and not Path(str(path)).is_absolute()


def configmap_name(job: str) -> str:
    """The ConfigMap that holds job ``job``'s shipped files."""
    return f"{job}-files"


def for_pods(spec: JobSpec, base: Path, source: str) -> tuple[JobSpec, dict[str, str]]:
    """The spec as the pods run it, and the files to ship (name -> text); :class:`SpecError` for what cannot go."""
    problems: list[tuple[str, str]] = []
    every_pod = "a URL every pod reaches or an absolute path on a volume every pod mounts"
    if _local_relative(spec.checkpoint.url):
        problems.append(("checkpoint.url", f"{spec.checkpoint.url!r} is a path on this machine; on Kubernetes every "
                                           f"pod writes checkpoints there, so it must be {every_pod} (s3://...)"))
    for i, ds in enumerate(spec.datasets):
        if _local_relative(ds.uri):
            problems.append((f"datasets[{i}].uri", f"{ds.uri!r} is a path on this machine; on Kubernetes every "
                                                   f"pod reads it, so it must be {every_pod}"))  # fmt: skip
    tls = spec.master.tls
    if tls is not None and not tls.secret:
        problems.append(("master.tls", "cert, key and ca are files on this machine, not in the pods: on Kubernetes "
                                       "name Secrets (master.tls.secret, cert-manager's layout: tls.crt, tls.key, "
                                       "ca.crt; client_secret for mutual TLS)"))  # fmt: skip
    files: dict[str, str] = {}
    script = spec.trainer.script
    if _local_relative(script):
        path = (base / script).resolve()
        key = path.name if _KEY.match(path.name) else "train.py"
        try:
            data = path.read_bytes()
        except OSError as exc:
            problems.append(("trainer.script", f"cannot read {path} to ship it to the pods: {exc.strerror or exc}"))
        else:
            if len(data) > MAX_BYTES:
                problems.append(("trainer.script", f"{path} is {len(data)} bytes, more than the {MAX_BYTES} that can "
                                                   "be shipped to the pods: put it on the image (an absolute path)"))
            try:
                files[key] = data.decode()
            except UnicodeDecodeError:
                problems.append(("trainer.script", f"{path} is not UTF-8 text: put it on the image (an absolute path)"))
        script = f"{FILES_MOUNT}/{key}"
    if problems:
        raise SpecError(source, problems)
    trainer = spec.trainer.model_copy(update={"script": script})
    return spec.model_copy(update={"trainer": trainer}), files
