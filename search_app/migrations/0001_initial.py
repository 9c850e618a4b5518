import django.db.models.deletion
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVector
from django.db import migrations, models

# The full-text index, per database (search_app/search.py reads it the same way):
# SQLite: an FTS5 table over the passages' text, kept by triggers;
# PostgreSQL: a GIN index on the same to_tsvector('simple', text) expression the query uses.
SQLITE_FTS = [
    "CREATE VIRTUAL TABLE search_app_passage_fts USING fts5(text, content='search_app_passage',"
    " content_rowid='id', tokenize='unicode61 remove_diacritics 2')",
    "CREATE TRIGGER search_app_passage_ai AFTER INSERT ON search_app_passage BEGIN"
    " INSERT INTO search_app_passage_fts(rowid, text) VALUES (new.id, new.text); END",
    "CREATE TRIGGER search_app_passage_ad AFTER DELETE ON search_app_passage BEGIN"
    " INSERT INTO search_app_passage_fts(search_app_passage_fts, rowid, text) VALUES ('delete', old.id, old.text); END",
    "CREATE TRIGGER search_app_passage_au AFTER UPDATE OF text ON search_app_passage BEGIN"
    " INSERT INTO search_app_passage_fts(search_app_passage_fts, rowid, text) VALUES ('delete', old.id, old.text);"
    " INSERT INTO search_app_passage_fts(rowid, text) VALUES (new.id, new.text); END",
]
SQLITE_FTS_DROP = [
    "DROP TRIGGER IF EXISTS search_app_passage_au",
    "DROP TRIGGER IF EXISTS search_app_passage_ad",
    "DROP TRIGGER IF EXISTS search_app_passage_ai",
    "DROP TABLE IF EXISTS search_app_passage_fts",
]
PG_INDEX = GinIndex(SearchVector("text", config="simple"), name="search_passage_fts")


def add_full_text(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        for sql in SQLITE_FTS:
            schema_editor.execute(sql)
    elif vendor == "postgresql":
        schema_editor.add_index(apps.get_model("search_app", "Passage"), PG_INDEX)


def drop_full_text(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        for sql in SQLITE_FTS_DROP:
            schema_editor.execute(sql)
    elif vendor == "postgresql":
        schema_editor.remove_index(apps.get_model("search_app", "Passage"), PG_INDEX)


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("sessions_app", "0009_status_words_with_sleeping"),
    ]

    operations = [
        migrations.CreateModel(
            name="Passage",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("seq", models.PositiveBigIntegerField()),
                ("last_seq", models.PositiveBigIntegerField()),
                ("role", models.CharField(choices=[("user", "user"), ("assistant", "assistant")], max_length=10)),
                ("who", models.CharField(blank=True, max_length=150)),
                ("text", models.TextField()),
                ("session", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="passages",
                                              to="sessions_app.agentsession")),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("session", "seq"), name="one_passage_per_start")],
            },
        ),
        migrations.CreateModel(
            name="Indexed",
            fields=[
                ("session", models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True,
                                                 related_name="search_index", serialize=False,
                                                 to="sessions_app.agentsession")),
                ("upto", models.PositiveBigIntegerField(default=0)),
                ("open_passage", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                                   related_name="+", to="search_app.passage")),
            ],
        ),
        migrations.RunPython(add_full_text, drop_full_text),
    ]
