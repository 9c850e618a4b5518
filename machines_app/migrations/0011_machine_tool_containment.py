from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0010_slot_saves_and_idle_time'),
    ]

    operations = [
        migrations.AddField(
            model_name='machine',
            name='bwrap_path',
            field=models.CharField(blank=True, default='bwrap', help_text="bubblewrap on that machine (bwrap, or its absolute path). Each llama-server, and every command its tools run, is started in a sandbox that hides Corral's files there and Corral's other processes. Empty: no sandbox, and tools can read Corral's files on that machine (on this backend: its database, secret key and SSH keys). Where bubblewrap is missing, a server on this backend is not started; one on an SSH machine starts without the sandbox and this page says so.", max_length=500, verbose_name='bubblewrap'),
        ),
        migrations.AddField(
            model_name='machine',
            name='containment',
            field=models.CharField(choices=[('unchecked', 'not checked yet (no server started since)'), ('contained', 'contained by bubblewrap'), ('exposed', 'NOT contained')], default='unchecked', max_length=20, verbose_name='tool containment'),
        ),
        migrations.AddField(
            model_name='machine',
            name='containment_reason',
            field=models.TextField(blank=True, help_text='Why tools there are not contained, in plain words.'),
        ),
    ]
