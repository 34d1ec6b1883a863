"""`batchllm keys`: revoking never guesses between keys, and key names are bounded."""

from __future__ import annotations

import pytest

from batchllm.api.keys import create_key, list_keys
from batchllm.store.db import session_scope
from batchllm.store.models import ApiKey
from tests.support.cli import invoke


def live(settings) -> dict[str, str]:
    """id -> name of the keys not revoked."""
    with session_scope(settings) as session:
        return {row.id: row.name for row in list_keys(session) if row.revoked_at is None}


def new_key(settings, name: str) -> str:
    with session_scope(settings) as session:
        row, _ = create_key(session, name)
        return row.id


def test_revoking_a_name_two_keys_share_is_refused_naming_both(settings):
    first, second = new_key(settings, "alice"), new_key(settings, "alice")

    result = invoke("keys", "revoke", "alice")

    assert result.exit_code != 0
    (line,) = result.output.strip().splitlines()
    assert f"2 live API keys match 'alice' ({first}, {second}); revoke by id" in line
    assert live(settings) == {first: "alice", second: "alice"}

    assert invoke("keys", "revoke", second).output.strip() == f"key {second} revoked"
    assert live(settings) == {first: "alice"}
    assert invoke("keys", "revoke", "alice").output.strip() == f"key {first} revoked"


def test_a_key_named_like_another_keys_id_does_not_revoke_the_other(settings):
    target = new_key(settings, "bob")
    with session_scope(settings) as session:  # a name from before names were checked
        session.add(ApiKey(id="key_00000000000000aa", name=target, key_hash="0" * 64))

    result = invoke("keys", "revoke", target)

    assert result.exit_code != 0
    assert f"({target}, key_00000000000000aa)" in result.output
    assert set(live(settings)) == {target, "key_00000000000000aa"}


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("key_0123456789abcdef", "must not start with 'key_'"),
        ("", "1 to 128 characters, not 0"),
        ("x" * 129, "1 to 128 characters, not 129"),
        ("alice\nbob", "only printable characters"),
        ("al\x1b[31mice", "only printable characters"),
        ("   ", "not only spaces"),
    ],
)
def test_key_names_are_bounded_at_create(settings, name, says):
    result = invoke("keys", "create", name)

    assert result.exit_code != 0
    (line,) = result.output.strip().splitlines()
    assert says in line
    assert "sk-batchllm-" not in result.output
    assert live(settings) == {}


@pytest.mark.parametrize("name", ["a", "x" * 128, "team search (prod)", "équipe-données"])
def test_printable_names_up_to_128_characters_are_kept(settings, name):
    result = invoke("keys", "create", name)

    assert result.exit_code == 0, result.output
    assert list(live(settings).values()) == [name]


def test_a_keys_webhook_gives_its_batches_the_url_and_a_new_secret(settings):
    from batchllm.api.keys import webhook_of

    key_id = new_key(settings, "alice")
    result = invoke("keys", "webhook", "alice", "https://alice.example.com/hook")
    assert result.exit_code == 0, result.output
    with session_scope(settings) as session:
        target = webhook_of(session, key_id)
    assert target is not None and target.url == "https://alice.example.com/hook"
    assert target.secret.startswith("whsec_") and target.secret in result.output
    assert "https://alice.example.com/hook" in invoke("keys", "list").output

    assert invoke("keys", "webhook", "alice", "--clear").exit_code == 0
    with session_scope(settings) as session:
        assert webhook_of(session, key_id) is None
    refused = invoke("keys", "webhook", "alice", "file:///etc/passwd")
    assert refused.exit_code != 0 and "must be http:// or https://" in refused.output


def test_an_admin_key_is_created_as_such_and_other_keys_are_not(settings):
    admin = invoke("keys", "create", "ops", "--admin")
    plain = invoke("keys", "create", "alice")
    assert admin.exit_code == 0 and plain.exit_code == 0, admin.output + plain.output
    assert "admin key key_" in admin.stderr
    with session_scope(settings) as session:
        assert {row.name: row.admin for row in list_keys(session)} == {"ops": True, "alice": False}
    listed = {
        line.split()[1]: line.split()[-1] for line in invoke("keys", "list").output.splitlines()[1:]
    }
    assert listed == {"ops": "yes", "alice": "-"}


def test_a_keys_weight_and_token_limit_are_set_listed_and_reset(settings):
    key_id = new_key(settings, "alice")
    new_key(settings, "bob")

    result = invoke("keys", "limits", "alice", "--weight", "2.5", "--enqueued-tokens", "50000")

    assert result.exit_code == 0, result.output
    assert f"key {key_id}: weight 2.5, enqueued-token limit 50,000 per model" in result.output
    listed = {
        line.split()[1]: line.split()[-3:-1]
        for line in invoke("keys", "list").output.splitlines()[1:]
    }
    assert listed == {"alice": ["2.5", "50,000"], "bob": ["1", "-"]}
    reset = invoke("keys", "limits", key_id, "--default-tokens")
    assert "weight 2.5, enqueued-token limit 1,000,000,000 (BATCHLLM_API_MAX_ENQUEUED_TOKENS)" in (
        reset.output
    )
    with session_scope(settings) as session:
        row = session.get(ApiKey, key_id)
        assert (row.share_weight, row.enqueued_token_limit) == (2.5, None)
    refused = invoke("keys", "limits", "alice", "--weight", "0")
    assert refused.exit_code != 0 and "weight is over 0" in refused.output
