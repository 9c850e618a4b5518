// Attaching files to a message (docs/behaviour.md §16): pick, paste or drop.
//
// Images go into the composer's image input (#id_images, present only when the session's
// model takes images); any other file into its text-file input (#id_files: code, logs and
// Markdown go to any model as text). So a picked, pasted or dropped file is sent the same
// way, with the form. The lists under them name what will be sent; a file over a limit is
// said at once here, and refused by the server in the same words anyway. An image pasted
// or dropped on a model that cannot take images is said where it was dropped, never lost
// in silence.
(function () {
  "use strict";

  function imageInput() { return document.getElementById("id_images"); }
  function textInput() { return document.getElementById("id_files"); }

  function megabytes(size) {
    if (size >= 1000000) return (Math.round(size / 100000) / 10) + " MB";
    return Math.max(1, Math.round(size / 1000)) + " KB";
  }

  function showError(text) {
    const slot = document.getElementById("composer-error");
    if (!slot) return;
    slot.textContent = text;  // text, never markup
    slot.hidden = !text;
  }

  function list(field, id, maxBytes, tooBig) {
    const items = document.getElementById(id);
    const files = field ? Array.from(field.files) : [];
    if (items) {
      items.replaceChildren();
      files.forEach(function (file) {
        const item = document.createElement("li");
        item.textContent = file.name + " (" + megabytes(file.size) + ")";
        items.appendChild(item);
      });
    }
    const big = files.find(function (file) { return maxBytes && file.size > maxBytes; });
    return big ? big.name + " is " + megabytes(big.size) + "; " + tooBig + " can be at most " + megabytes(maxBytes) + "." : "";
  }

  // Name the attached files and check the limits; the text may be left empty once a file
  // is attached.
  function refresh(said) {
    const attach = document.getElementById("attach");
    const box = document.getElementById("id_text");
    if (!attach) return;
    const maxCount = parseInt(attach.dataset.maxCount || "0", 10);
    const images = imageInput();
    let problem = said || list(images, "attached", parseInt(attach.dataset.maxBytes || "0", 10), "an image");
    if (!problem && images && maxCount && images.files.length > maxCount) {
      problem = "A message can carry at most " + maxCount + " images; this one has " + images.files.length + ".";
    }
    const text = list(textInput(), "attached-files", parseInt(attach.dataset.textMaxBytes || "0", 10), "a text file");
    problem = problem || text;
    showError(problem);
    const count = (images ? images.files.length : 0) + (textInput() ? textInput().files.length : 0);
    if (box) box.required = count === 0;
  }

  function addTo(field, files) {
    const all = new DataTransfer();
    Array.from(field.files).forEach(function (f) { all.items.add(f); });
    files.forEach(function (f) { all.items.add(f); });
    field.files = all.files;
  }

  // Add pasted or dropped files, after the ones already there; true when any was taken
  // (or refused in words), so the browser does not also paste a name or open the file.
  function add(files) {
    files = Array.from(files || []);
    if (!files.length) return false;
    const isImage = function (f) { return f.type.indexOf("image/") === 0; };
    const images = files.filter(isImage);
    const texts = files.filter(function (f) { return !isImage(f); });
    let said = "";
    if (images.length && imageInput()) {
      addTo(imageInput(), images);
    } else if (images.length) {
      said = images.map(function (f) { return f.name || "The image"; }).join(", ")
        + (images.length > 1 ? " were" : " was") + " not attached: this session's model cannot take images. "
        + "Text files go to any model; for images, choose a model that takes them in Settings.";
    }
    if (texts.length && textInput()) addTo(textInput(), texts);
    refresh(said);
    return true;
  }

  function inComposer(node) {
    return node && node.closest && node.closest("#composer");
  }

  document.addEventListener("change", function (e) {
    if (e.target && (e.target.id === "id_images" || e.target.id === "id_files")) refresh("");
  });
  document.addEventListener("paste", function (e) {
    if (!inComposer(e.target) || !e.clipboardData || !e.clipboardData.files.length) return;
    if (add(e.clipboardData.files)) e.preventDefault();  // a file, not its name as text
  });
  // A file dropped anywhere on a page with a composer goes to it (taken or said there):
  // the browser would otherwise open the file in place of the session page.
  document.addEventListener("dragover", function (e) {
    if (document.getElementById("composer")) e.preventDefault();  // allow the drop
  });
  document.addEventListener("drop", function (e) {
    if (!document.getElementById("composer") || !e.dataTransfer || !e.dataTransfer.files.length) return;
    e.preventDefault();  // never let the browser open the file instead
    add(e.dataTransfer.files);
  });
})();
