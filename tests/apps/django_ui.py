"""Run by tests/test_ui_django.py in a process of its own (Django's settings
are global): the UI mounted in a project's URLconf, behind Django's auth."""

from __future__ import annotations

import json
import sys
import uuid

import django
from django.conf import settings
from psycopg import conninfo

if __name__ != "__main__":  # imported by Django as the URLconf, after settings.configure()
    from django.urls import include, path

    urlpatterns = [path("ops/", include("everystep.ui.django_urls"))]


def main(url: str) -> None:
    params = conninfo.conninfo_to_dict(url)
    settings.configure(
        DEBUG=False, SECRET_KEY="test-only", ROOT_URLCONF="tests.apps.django_ui", ALLOWED_HOSTS=["testserver"],
        EVERYSTEP_UI_DATABASE_URL=url, LOGIN_URL="/login/",
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions"],
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "django.middleware.csrf.CsrfViewMiddleware",
                    "django.contrib.auth.middleware.AuthenticationMiddleware"],
        DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": params["dbname"], "USER": params.get("user", ""),
            "HOST": params.get("host", ""), "PORT": params.get("port", ""),
            "OPTIONS": {"options": params.get("options", "")},
        }},
    )
    django.setup()
    from django.contrib.auth.models import User  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.test import Client  # noqa: PLC0415

    call_command("migrate", verbosity=0)
    staff = User.objects.create_user("ada", password="x", is_staff=True)
    plain = User.objects.create_user("bob", password="x")
    out: dict = {}
    client = Client(enforce_csrf_checks=True)
    out["anonymous"] = [client.get("/ops/").status_code, client.get("/ops/api/runs").status_code]
    client.force_login(plain)
    out["not_staff"] = client.get("/ops/api/runs").status_code
    client.force_login(staff)
    page = client.get("/ops/")
    out["page"] = page.status_code
    out["page_has_csrf"] = 'name="everystep-csrf-header" content="X-CSRFToken"' in page.content.decode()
    out["static"] = client.get("/ops/static/ui.js").status_code
    runs = client.get("/ops/api/runs")
    out["runs"] = [runs.status_code, [r["id"] for r in json.loads(runs.content)["runs"]]]
    out["bad_filter"] = client.get("/ops/api/runs?status=nope").status_code
    run_id = sys.argv[2]
    body = json.dumps({"run": run_id, "step": "1", "outcome": "discard"})
    answer = client.post("/ops/api/actions/resolve", body, content_type="application/json")
    out["post_without_csrf"] = answer.status_code
    token = client.cookies["csrftoken"].value
    answer = client.post("/ops/api/actions/resolve", body, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    out["post_with_csrf"] = answer.status_code
    stream = client.get("/ops/api/events")
    out["events"] = next(iter(stream.streaming_content)).decode()[:40]
    stream.close()
    out["unknown_run_stream"] = client.get(f"/ops/api/runs/{uuid.uuid4()}/streams/out").status_code
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
