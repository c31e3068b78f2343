"""Contracts at the Temporal boundary: what workflows and activities agree on.

Every activity has one contract object here (`Activity[Args, Result]`: its name, its
argument model and its result type). A workflow calls an activity only through it
(`GENERATE.execute(args, task_queue=..., ...)`), and the implementation takes its name
from it (`@implements(GENERATE)`, belayer/activities/runtime.py), so the name and the
types are written once. The error types workflows react to are named in `errors`.

Where the models live, one rule: an activity's argument and result models are defined
here; the domain value types they carry (handles, refs, specs, records: pydantic models
that the domain code producing them also uses) stay in that domain package and are
re-exported here, so workflows import both from this package and never from the
sandbox, the activities, the workers or the rollout node.

This package sits between the domain packages and the workflows: it imports domain value
types and `temporalio.workflow`, never activity-side code (`temporalio.activity`, the
activities, workers, sandbox internals).

Versions, for rolling upgrades (`activity.CONTRACT_VERSION`): a change that only adds
fields with defaults keeps the version; readers ignore fields they do not know (at any
depth) and fill the defaults of fields a writer did not send, so such a change is
compatible both ways. Anything else (a field renamed, removed, made required, its type
changed) raises the version. The version travels beside the JSON, in the payload's
metadata, so payloads keep their shape and recorded histories replay; a worker that cannot
read the arguments it receives fails that activity non-retryably, naming both versions.
"""
