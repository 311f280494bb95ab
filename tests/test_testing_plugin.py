"""The pytest plugin as a project uses it: test projects run by pytester in
a pytest of their own (a subprocess: the plugin is loaded as an installed
package's), on the test server (EVERYSTEP_TEST_DATABASE_URL, which the
server_url fixture sets)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SHOP = '''
import itertools

import everystep
from everystep import step, workflow

SENT = []  # receipts "e-mailed": an effect outside the database, done again if the step runs again
KEYS = {}  # the mail provider's idempotency keys


@step
def remind(customer, hour):
    return f"{customer}: hour {hour}"


@step
def send_receipt(email):
    SENT.append(email)  # not idempotent: a second call sends a second receipt
    return len(SENT)


@step
def send_receipt_once(email):
    key = f"{everystep.current().workflow_id}:receipt"  # idempotent: the provider drops a repeated key
    KEYS.setdefault(key, email)
    return list(KEYS.values()).count(email)


@step(unsafe_to_repeat=True)
def charge(customer, amount):
    return f"ch_{customer}_{amount}"


@workflow
def reminders(customer, hours):
    sent = []
    for hour in range(hours):
        everystep.sleep(3600)
        sent.append(remind(customer, hour))
    return sent


@workflow
def report(label):
    return label


@workflow
def checkout(customer, email):
    charge(customer, 20)
    return send_receipt(email)


@workflow
def checkout_once(customer, email):
    charge(customer, 20)
    return send_receipt_once(email)
'''

TESTS = '''
import datetime as dt
import sys

import pytest

import everystep
from everystep import faults, schedules
from everystep.testing import (advance, assert_ended, assert_scheduled, crash_after_step, drain, freeze,
                               scheduled_runs)

import shop


def start(conn, fn, *args):
    with everystep.transaction(conn):
        return everystep.schedule(fn, *args)


def test_a_day_of_sleeps_and_schedules(everystep_db):
    freeze(everystep_db, dt.datetime(2030, 1, 1, 0, 10, tzinfo=dt.UTC))
    run = start(everystep_db, shop.reminders, "ann", 24)
    with everystep.transaction(everystep_db):
        schedules.put("hourly-report", shop.report, ["sales"], cron="0 * * * *")
    assert drain() == {"waiting": 1}
    advance(everystep_db, 24 * 3600)
    assert len(assert_ended(run.id).result) == 24
    assert_scheduled(shop.report, "sales", status="completed", count=24)


def test_bob_checked_out_too(everystep_db):
    start(everystep_db, shop.checkout, "ann", "ann@example.com")
    assert_scheduled(shop.checkout, "bob", "bob@example.com")  # fails: the message says what there is


def test_the_receipt_is_sent_once_even_after_a_crash(everystep_db):
    run = start(everystep_db, shop.checkout, "ann", "ann@example.com")
    with crash_after_step(shop.send_receipt, before_outcome=True):
        drain()  # the worker dies right after the receipt went out, before its record
    drain()  # the next one replays the run
    assert_ended(run.id)
    assert shop.SENT == ["ann@example.com"]  # fails: the step ran again, a second receipt went out


def test_the_idempotent_receipt_is_sent_once_after_a_crash(everystep_db):
    run = start(everystep_db, shop.checkout_once, "bob", "bob@example.com")
    with crash_after_step(shop.send_receipt_once, before_outcome=True):
        drain()
    drain()
    assert assert_ended(run.id).result == 1
    assert list(shop.KEYS.values()) == ["bob@example.com"]


def test_a_fault_left_armed(everystep_db):
    crash_after_step(shop.remind)


def test_is_disarmed_by_the_end_of_its_test(everystep_db):
    assert faults.ARMED == []


@pytest.mark.everystep(imports=["extra"])
def test_the_marker_imports_modules(everystep_db):
    assert "extra" in sys.modules
'''


@pytest.fixture
def project(pytester, server_url):
    pytester.makepyfile(shop=SHOP, extra="LOADED = True\n", test_shop=TESTS)
    return pytester


def test_a_project_tests_its_workflows_with_the_plugin(project):
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, failed=2)
    output = result.stdout.str()
    # The assertion says what it expected and what there is.
    assert ("E           AssertionError: expected a run of shop.checkout('bob', 'bob@example.com'), found 0; the "
            "other runs of shop.checkout:") in output
    assert re.search(r"E             \S+ scheduled shop.checkout\('ann', 'ann@example.com'\)", output)
    # The crash made the non-idempotent step run twice, and the test caught it.
    assert "Left contains one more item: 'ann@example.com'" in output
    assert "FAILED test_shop.py::test_bob_checked_out_too" in output
    assert "FAILED test_shop.py::test_the_receipt_is_sent_once_even_after_a_crash" in output


def test_the_plugin_is_inert_until_a_fixture_is_asked_for(pytester, monkeypatch):
    # A suite that asks for none of its fixtures reaches no database, not even a wrong one.
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    monkeypatch.setenv("EVERYSTEP_TEST_DATABASE_URL", "host=127.0.0.1 port=1 connect_timeout=1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--trace-config")
    result.assert_outcomes(passed=1)
    assert "PLUGIN registered: <module 'everystep.testing'" in result.stdout.str()


def test_the_plugin_enabled_by_name_without_autoloading(pytester, server_url, monkeypatch):
    pytester.makepyfile(test_db="def test_db(everystep_db):\n    assert everystep_db.execute('SELECT 1').fetchone()"
                                " == (1,)\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)  # fixture 'everystep_db' not found
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "everystep.testing")
    result.assert_outcomes(passed=1)


def docs_files() -> dict[str, str]:
    """The files of the complete example of docs/testing.md, by name: each a
    code block under a `<!-- file: NAME -->` line."""
    text = (ROOT / "docs" / "testing.md").read_text()
    return {name: code for name, code in re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", text, re.S)}


def test_the_example_of_the_docs_passes_in_under_30_lines(pytester, server_url):
    files = docs_files()
    assert sorted(files) == ["shop.py", "test_shop.py"]
    test_lines = [line for line in files["test_shop.py"].splitlines() if line.strip()]
    assert len(test_lines) < 30
    pytester.makepyfile(**{name.removesuffix(".py"): code for name, code in files.items()})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
