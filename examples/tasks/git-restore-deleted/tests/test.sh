#!/bin/bash
# Verifier: branch restore-limits is main + one commit restoring config/limits.ini
# (its last version before deletion), with the requested message; main is unchanged.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt

fail() { echo "FAIL: $*"; exit 0; }
g() { git -c safe.directory='*' -C /app "$@"; }

g rev-parse --verify -q refs/heads/main >/dev/null || fail "branch main is gone"
g rev-parse --verify -q refs/heads/restore-limits >/dev/null || fail "no branch restore-limits"

# main untouched: same five commits, same last subject, still without the file.
[ "$(g rev-list --count main)" = "5" ] || fail "main no longer has its 5 commits"
[ "$(g log -1 --format=%s main)" = "Document release process" ] || fail "main's tip changed"
[ "$(g log --format=%s main | tail -1)" = "Initial import" ] || fail "main's history was rewritten"
if g cat-file -e main:config/limits.ini 2>/dev/null; then
    fail "config/limits.ini was committed to main"
fi

# restore-limits: exactly one commit on top of main.
[ "$(g rev-parse restore-limits^)" = "$(g rev-parse main)" ] || fail "restore-limits is not one commit on top of main"
[ "$(g log -1 --format=%P restore-limits | wc -w)" = "1" ] || fail "the restore commit is a merge"
[ "$(g log -1 --format=%B restore-limits | sed '/^$/d')" = "Restore config/limits.ini" ] \
    || fail "commit message is '$(g log -1 --format=%B restore-limits)'"
[ "$(g diff --name-only main restore-limits)" = "config/limits.ini" ] \
    || fail "the commit changes: $(g diff --name-only main restore-limits | tr '\n' ' ')"

g show restore-limits:config/limits.ini > /tmp/restored_limits.ini || fail "no config/limits.ini on restore-limits"
cmp -s /tmp/restored_limits.ini /tests/expected_limits.ini || {
    diff /tests/expected_limits.ini /tmp/restored_limits.ini
    fail "config/limits.ini differs from its last version before deletion"
}

echo 1 > /logs/verifier/reward.txt
echo "PASS"
exit 0
