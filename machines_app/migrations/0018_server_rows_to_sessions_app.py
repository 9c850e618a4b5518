# ServerRecord and SlotSave belong to sessions_app now (sessions_app 0014 took them into
# its state). State only: their tables stay, under the names they always had.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0017_machine_corral_host'),
        ('sessions_app', '0014_server_rows_from_machines_app'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='ServerRecord'),
                migrations.DeleteModel(name='SlotSave'),
            ],
            database_operations=[],
        ),
    ]
